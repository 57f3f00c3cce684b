"""Bad output paths and bad checkpoints are refused before any work starts: every command
that writes (run --save/--report, plan -o, profile -o/--records) and every way a --resume
checkpoint can be wrong (unreadable, another model, another optimizer or its settings, a
step at or past --steps) exits 2 with `error: ...` naming the value, and nothing is written,
planned, launched or left behind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

import hetsynth
from hetsynth.cli import main
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.runtime import launch
from hetsynth.runtime.runstate import state_dir

# multi-process or seconds long: make test runs them, make test-fast does not
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "configs" / "clusters" / "local-emulated.toml"
REF = "gpt:tiny"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A plan, checkpoints good and bad (written as `hetsynth run --save` writes them)."""
    d = tmp_path_factory.mktemp("inputs")
    plan = hetsynth.plan(REF, cluster=str(CLUSTER), ratios=[0.25] * 4)
    hetsynth.save_plan(plan, d / "plan.json")
    out = {"plan": str(d / "plan.json"), "dir": str(d)}
    for name, ref, kind, lr in (("ck5", REF, "adamw", 1e-3), ("sgd", REF, "sgd", 1e-3), ("lr", REF, "adamw", 0.1),
                                ("vocab", "gpt:tiny,vocab_size=65", "adamw", 1e-3)):
        model = parse_model_ref(ref).build("cpu").state_dict()
        torch.save({"format": 1, "model_ref": ref, "step": 5, "model": model,
                    "optimizer": {"kind": kind, "settings": {"lr": lr, "weight_decay": 0.01}, "state": {}}},
                   d / f"{name}.pt")
        out[name] = str(d / f"{name}.pt")
    good = (d / "ck5.pt").read_bytes()
    (d / "truncated.pt").write_bytes(good[: len(good) // 2])
    (d / "garbage.pt").write_bytes(os.urandom(4096))
    torch.save({"weights": torch.zeros(2)}, d / "other.pt")
    out |= {k: str(d / f"{k}.pt") for k in ("truncated", "garbage", "other")}
    return out


# (command line with {placeholders} from `files`, the value the message must name, what it must say)
CASES = [
    ("run {plan} --save /nonexistent-dir/ck.pt", "/nonexistent-dir/ck.pt", "does not exist"),
    ("run {plan} --save {dir}", "{dir}", "is a directory"),
    ("run {plan} --save /proc/ck.pt", "/proc/ck.pt", "cannot write"),
    ("run {plan} --report /nonexistent-dir/r.json", "/nonexistent-dir/r.json", "does not exist"),
    ("run {plan} --report /proc/r.json", "/proc/r.json", "cannot write"),
    ("run {plan} --save {dir}/x.pt --report {dir}/x.pt", "{dir}/x.pt", "same file"),
    ("run {plan} --resume {dir}/missing.pt", "{dir}/missing.pt", "no such file"),
    ("run {plan} --resume {garbage}", "{garbage}", "not a checkpoint torch can read"),
    ("run {plan} --resume {truncated}", "{truncated}", "not a checkpoint torch can read"),
    ("run {plan} --resume {other}", "{other}", "not a hetsynth checkpoint"),
    ("run {plan} --resume {vocab} --steps 9", "{vocab}", "checkpoint shape (65, 32), model (64, 32)"),
    ("run {plan} --resume {sgd} --steps 9", "{sgd}", "--optimizer sgd, not adamw"),
    ("run {plan} --resume {lr} --steps 9", "{lr}", "lr 0.001 (checkpoint 0.1)"),
    ("run {plan} --resume {ck5} --steps 3", "--steps 3", "holds step 5"),
    ("run {plan} --resume {ck5} --steps 5", "--steps 5", "holds step 5"),
    ("run {plan} --steps 0", "--steps 0", "at least 1"),
    ("run {plan} --timeout nan", "--timeout nan", "positive number of seconds"),
    ("plan --model gpt:tiny --cluster " + str(CLUSTER) + " -o /nonexistent-dir/p.json", "/nonexistent-dir/p.json",
     "does not exist"),
    ("plan --model gpt:tiny --cluster " + str(CLUSTER) + " -o {dir}", "{dir}", "is a directory"),
    ("plan --model gpt:tiny --cluster " + str(CLUSTER) + " -o /proc/p.json", "/proc/p.json", "cannot write"),
    ("profile --cluster " + str(CLUSTER) + " -o /proc/x.toml", "/proc/x.toml", "cannot write"),
    ("profile --cluster " + str(CLUSTER) + " -o /nonexistent-dir/m.toml", "/nonexistent-dir/m.toml", "does not exist"),
    ("profile --cluster " + str(CLUSTER) + " --records /proc/r.json", "/proc/r.json", "cannot write"),
]


def _no_work(*args: object, **kwargs: object) -> None:
    raise AssertionError("work started before the inputs were checked")


def _temp_entries() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("hetsynth-run-")}


@pytest.mark.parametrize("line, value, says", CASES, ids=[c[0].split(" -")[0] + " " + c[2] for c in CASES])
def test_bad_input_fails_first_and_leaves_nothing(files: dict[str, str], line: str, value: str, says: str,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("launch_in", "launch_checked", "launch"):
        monkeypatch.setattr(launch, name, _no_work)
    monkeypatch.setattr(hetsynth, "plan", _no_work)
    before_files, before_temp = set(os.listdir(files["dir"])), _temp_entries()
    states = set(state_dir().glob(f"{os.getpid()}-*")) if state_dir().is_dir() else set()
    assert main(line.format(**files).split()) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and value.format(**files) in err and says in err, err
    assert "Traceback" not in err
    assert set(os.listdir(files["dir"])) == before_files  # no checkpoint, report or probe file
    assert _temp_entries() == before_temp
    assert (set(state_dir().glob(f"{os.getpid()}-*")) if state_dir().is_dir() else set()) == states


TYPED_FACTORY = """
from __future__ import annotations
import torch


class M(torch.nn.Module):
    def __init__(self, width, wide, scale, name):
        super().__init__()
        self.l = torch.nn.Linear(width, 1)
        self.seen = (width, wide, scale, name)

    def forward(self, x):
        return self.l(x).sum()


def make(batch_size: int = 4, width=3, wide: bool = False, scale: float = 1.0, name="m", **extra):
    model = M(width, wide, scale, name)
    model.extra = extra
    return model, (torch.zeros(batch_size, width),)
"""


def test_factory_overrides_arrive_as_the_parameters_types(tmp_path: Path) -> None:
    """`path.py:make,k=v` passes each value as the type its parameter is annotated with (string
    annotations too) or defaults to, else as the string: batch_size=16 is 16, which a
    pipeline's micro-batch capture (with_overrides(batch_size=...)) relies on."""
    path = tmp_path / "typed.py"
    path.write_text(TYPED_FACTORY)
    spec = parse_model_ref(f"{path}:make,batch_size=6,width=5,wide=true,scale=0.25,name=7,other=x")
    module = spec.build("cpu")
    assert module.seen == (5, True, 0.25, "7") and module.extra == {"other": "x"}
    assert tuple(spec.example_inputs()[0].shape) == (6, 5)
