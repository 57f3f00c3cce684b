"""`hetsynth launch PLAN SCRIPT [ARGS...]`: a user's script on every rank of a plan's cluster
(plain local processes, and the emulated cluster when root), its arguments passed through, the
plan file's absolute path in HETSYNTH_PLAN; a rank that raises, exits non-zero or stops is
named and nothing is left behind. And `hetsynth run` on a plan made from a module: with
`--model file.py:factory` it trains, without one it fails before any rank starts."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

import hetsynth
from hetsynth.cli import main
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.instruction_set.models import ModelRefError
from hetsynth.runtime import emulation, launch
from hetsynth.runtime.script_runner import RankPrefixed, exit_message
from test_launch import ROOT, hetsynth_cli

EMULATED = load_cluster(ROOT / "configs" / "clusters" / "local-emulated.toml").first(2)
LOCAL = EMULATED.model_copy(update={"emulation": None})

NET = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4, bias=bias)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.fc(x), y)


def make(bias: str = "true"):
    return Net(bias == "true"), (torch.randn(8, 8), torch.randn(8, 4))
'''

# writes what the rank saw into OUT/rank<N>.txt; `--fail raise|exit|stop` misbehaves on rank 1 only
SCRIPT = '''
import argparse, json, os, signal, sys, time

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--lr", type=float)
p.add_argument("--fail")
args = p.parse_args()
rank = os.environ["RANK"]
if rank == "1" and args.fail == "raise":
    raise ValueError("bad rank one")
if rank == "1" and args.fail == "exit":
    sys.exit(3)
if rank == "1" and args.fail == "stop":
    os.kill(os.getpid(), signal.SIGSTOP)
if args.fail == "stop":
    time.sleep(120)
seen = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                   "HETSYNTH_PLAN", "HETSYNTH_PLAN_SHA256")}
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump({"env": seen, "argv": sys.argv, "lr": args.lr, "name": __name__,
               "timeout": os.environ.get("HETSYNTH_TIMEOUT")}, f)
print(f"hello from {rank}")
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """net.py (a factory file), script.py, and plans of Net made from the module (its class
    name as the plan's model) on two plain local CPUs and on the emulated cluster's first node."""
    d = tmp_path_factory.mktemp("launch")
    (d / "net.py").write_text(NET)
    (d / "script.py").write_text(SCRIPT)
    spec = importlib.util.spec_from_file_location("launch_test_net", d / "net.py")
    net = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(net)
    module, inputs = net.make()
    for name, cluster in (("plan", LOCAL), ("emulated", EMULATED)):
        hetsynth.save_plan(hetsynth.plan(module, inputs, cluster), d / f"{name}.json")
    return {"dir": str(d), "net": str(d / "net.py"), "script": str(d / "script.py"),
            "plan": str(d / "plan.json"), "emulated": str(d / "emulated.json")}


def runners_alive(script: str) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if "hetsynth.runtime.script_runner" in line and script in line]


def launched(files: dict[str, str], plan: str, tmp_path: Path, *options: str) -> list[dict]:
    """Launch (with `options`) the script on `plan` (given relative to the repository root:
    HETSYNTH_PLAN must be absolute) with `--out tmp_path --lr 0.1`; what each rank saw."""
    out = hetsynth_cli("launch", *options, os.path.relpath(plan, ROOT), files["script"], "--out", str(tmp_path),
                       "--lr", "0.1", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 0 hello from 0" in out.stdout and "rank 1 hello from 1" in out.stdout, out.stdout
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_launch_runs_the_script_on_every_rank(files: dict[str, str], tmp_path: Path) -> None:
    ranks = launched(files, files["plan"], tmp_path)
    for rank, seen in enumerate(ranks):
        env = seen["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == (str(rank), "2", str(rank),
                                                                                        "127.0.0.1")
        assert env["HETSYNTH_PLAN"] == files["plan"] and files["plan"] in env["HETSYNTH_PLAN_SHA256"]
        assert seen["argv"] == [files["script"], "--out", str(tmp_path), "--lr", "0.1"] and seen["lr"] == 0.1
        assert seen["name"] == "__main__" and seen["timeout"] is None  # hetsynth.parallelize's default
    assert hetsynth.load_plan(ranks[0]["env"]["HETSYNTH_PLAN"]).model.ref == "Net"


@pytest.mark.skipif(emulation.unavailable() is not None, reason=f"no emulation here: {emulation.unavailable()}")
@pytest.mark.slow
def test_launch_runs_on_the_emulated_cluster(files: dict[str, str], tmp_path: Path) -> None:
    """The spec's emulation section: each rank in its node's network namespace, its store at
    the node's address, not loopback; --timeout is the collective timeout hetsynth.parallelize
    gives the process group it creates."""
    ranks = launched(files, files["emulated"], tmp_path, "--timeout", "45")
    assert [r["env"]["RANK"] for r in ranks] == ["0", "1"] and [r["timeout"] for r in ranks] == ["45.0"] * 2
    assert all(r["env"]["MASTER_ADDR"] not in ("127.0.0.1", "localhost") for r in ranks), ranks
    assert ranks[0]["env"]["HETSYNTH_PLAN"] == files["emulated"]


@pytest.mark.parametrize("fail, says", [("raise", "rank 1 failed: ValueError: bad rank one"),
                                        ("exit", "rank 1 failed: exited with status 3 (sys.exit)"),
                                        ("stop", "rank 1 failed: stopped making progress")])
@pytest.mark.slow
def test_a_failing_rank_is_named_and_nothing_is_left(files: dict[str, str], tmp_path: Path, fail: str,
                                                     says: str) -> None:
    started = time.monotonic()
    out = hetsynth_cli("launch", "--timeout", "3", files["plan"], files["script"], "--out", str(tmp_path),
                       "--fail", fail, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"hetsynth launch: {says}" in out.stderr and "the other ranks were stopped" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    if fail == "raise":  # the script's own traceback, on its rank's lines
        assert "rank 1 Traceback" in out.stdout and 'rank 1     raise ValueError("bad rank one")' in out.stdout
    assert time.monotonic() - started < 60
    time.sleep(0.5)
    assert runners_alive(files["script"]) == []


def _no_work(*args: object, **kwargs: object) -> None:
    raise AssertionError("a rank was started")


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("launch_in", "launch", "launch_checked"):
        monkeypatch.setattr(launch, name, _no_work)


def test_bad_launch_inputs(files: dict[str, str], no_launch: None, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, says in ((["launch", files["plan"], files["dir"] + "/missing.py"], "/missing.py' does not exist"),
                       (["launch", files["plan"], files["dir"]], "is a directory"),
                       (["launch", "--timeout", "0", files["plan"], files["script"]], "--timeout 0"),
                       (["launch", files["dir"] + "/none.json", files["script"]], "none.json")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err, err


@pytest.mark.slow
def test_run_a_plan_made_from_a_module_with_model(files: dict[str, str], tmp_path: Path) -> None:
    rel = os.path.relpath(files["net"], ROOT)  # a relative file.py:factory, as a user types it
    out = hetsynth_cli("run", files["plan"], "--model", f"{rel}:make", "--steps", "2",
                       "--save", str(tmp_path / "ck.pt"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "step    2/2" in out.stdout
    assert torch.load(tmp_path / "ck.pt", weights_only=True)["model_ref"] == f"{rel}:make"
    assert hetsynth.load_plan(files["plan"]).model.ref == "Net"  # the plan file itself is left as it was


def test_run_refuses_a_module_plan_before_any_rank(files: dict[str, str], no_launch: None,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", files["plan"], "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the plan's model 'Net' is not a model reference (the plan was made from a module); "
                          "give --model file.py:factory that builds it, or train it in your own script with "
                          "hetsynth.parallelize (hetsynth launch)"), err


def test_run_model_must_capture_to_the_plan(files: dict[str, str], no_launch: None,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", files["plan"], "--steps", "2", "--model", f"{files['net']}:make,bias=false"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --model {files['net']}:make,bias=false: not the model the plan was made for "
                          f"('Net'): param 'fc.bias'"), err
    assert main(["run", files["plan"], "--model", "gpt:nope"]) == 2
    assert "no preset 'nope'" in capsys.readouterr().err


def test_plan_records_model_ref(files: dict[str, str]) -> None:
    spec = importlib.util.spec_from_file_location("launch_test_net2", files["net"])
    net = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(net)
    module, inputs = net.make()
    ref = f"{files['net']}:make"
    assert hetsynth.capture_model(module, inputs, model_ref=ref).model_ref == ref
    with pytest.raises(ModelRefError, match="does not exist"):
        hetsynth.capture_model(module, inputs, model_ref=files["dir"] + "/none.py:make")
    with pytest.raises(ValueError, match="applies to a module"):
        hetsynth.plan("gpt:tiny", cluster=LOCAL, model_ref=ref)


def test_rank_prefix_and_exit_codes() -> None:
    sink = io.StringIO()
    out = RankPrefixed(sink, 3)
    out.write("a\nb")
    assert sink.getvalue() == "rank 3 a\n"
    out.write("c\n\n")
    out.flush()
    assert sink.getvalue() == "rank 3 a\nrank 3 bc\nrank 3 \n"
    out.write("50%")
    out.flush()  # print(..., end="", flush=True): shown now, its line not prefixed twice
    out.write(" 100%\n")
    assert sink.getvalue().endswith("rank 3 \nrank 3 50% 100%\n")
    assert exit_message(None) == (0, None) and exit_message(0) == (0, None)
    assert exit_message(3) == (3, "exited with status 3 (sys.exit)")
    assert exit_message("bye") == (1, "SystemExit: bye")

