"""hetsynth run / explain end to end: torchrun on this machine, single-device check, a rank
killed mid-run, per-node commands for a multi-node cluster, and the explained program."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hetsynth
from hetsynth.instruction_set.cluster import load_cluster

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = ROOT / "configs" / "clusters"


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("run") / "plan.json"
    plan = hetsynth.plan("gpt:tiny,dtype=float64", cluster=str(CLUSTERS / "local-emulated.toml"),
                         ratios=[0.4, 0.3, 0.2, 0.1])
    hetsynth.save_plan(plan, path)
    return str(path)


def hetsynth_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetsynth", *args], capture_output=True, text=True,
                          cwd=ROOT, env=os.environ | (env or {}), timeout=timeout)


def workers_alive(plan_path: str) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if "hetsynth.runtime.worker" in line and plan_path in line]


@pytest.mark.slow
def test_run_matches_single_device_and_resumes(plan_file: str, tmp_path: Path) -> None:
    """Two steps on two devices saved (with --memory-report: a row per rank, predicted and
    measured agree; runtime.memory_report), then resumed to three under the four-device plan
    with --check: the resumed run matches three steps of single-device training, and each
    checkpoint is labelled with the steps it holds."""
    import torch

    two = tmp_path / "two.json"
    hetsynth.save_plan(hetsynth.plan("gpt:tiny,dtype=float64", cluster=str(CLUSTERS / "local-emulated.toml"),
                                     ratios=[0.7, 0.3], num_devices=2), two)
    first, second = tmp_path / "ck2.pt", tmp_path / "ck3.pt"
    report = tmp_path / "report.json"
    out = hetsynth_cli("run", str(two), "--steps", "2", "--save", str(first), "--memory-report", "--report", str(report))
    assert out.returncode == 0 and f"saved {first} (step 2)" in out.stdout, out.stdout + out.stderr
    assert "memory per rank" in out.stdout and "saved pred" in out.stdout
    rows = json.loads(report.read_text())["memory"]
    assert [r["rank"] for r in rows] == [0, 1] and all(r["saved_peak"] > 0 and r["optimizer"] > 0 for r in rows)
    assert all(abs(r["state_error"]) <= 0.15 and abs(r["saved_error"]) <= 0.25 for r in rows), rows
    out = hetsynth_cli("run", plan_file, "--steps", "3", "--resume", str(first), "--save", str(second),
                       "--check", "--tolerance", "1e-9")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "training steps 3-3" in out.stdout and "step    3/3" in out.stdout and "step    2/3" not in out.stdout
    assert "check:" in out.stdout and "OK" in out.stdout
    saved = [torch.load(p, weights_only=True) for p in (first, second)]
    assert [c["step"] for c in saved] == [2, 3]
    assert saved[1]["optimizer"]["kind"] == "adamw" and saved[1]["optimizer"]["settings"]["lr"] == 1e-3


@pytest.mark.slow
def test_float32_run_resumed_with_check(tmp_path: Path) -> None:
    """A float32 plan resumed with --check: its float64 twin and the single-device references
    resume from the same checkpoint (cast to float64 for the twin), so the comparison stays at
    1e-9 although the checkpoint holds float32 values."""
    two = tmp_path / "two.json"
    hetsynth.save_plan(hetsynth.plan("gpt:tiny", cluster=str(CLUSTERS / "local-emulated.toml"),
                                     ratios=[0.7, 0.3], num_devices=2), two)
    ckpt = tmp_path / "ck1.pt"
    out = hetsynth_cli("run", str(two), "--steps", "1", "--save", str(ckpt))
    assert out.returncode == 0, out.stdout + out.stderr
    out = hetsynth_cli("run", str(two), "--steps", "2", "--resume", str(ckpt), "--check")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "training steps 2-2" in out.stdout and "check (information) float32" in out.stdout
    assert "check: float64" in out.stdout and "OK" in out.stdout


@pytest.mark.slow
def test_killed_rank_is_named_and_nothing_is_left(plan_file: str) -> None:
    start = time.monotonic()
    out = hetsynth_cli("run", plan_file, "--steps", "40", "--timeout", "120", env={"HETSYNTH_FAULT": "1:2:kill"})
    elapsed = time.monotonic() - start
    assert out.returncode != 0
    assert "rank 1 failed" in out.stderr and "SIGKILL" in out.stderr, out.stderr[-2000:]
    # start-up included (up to a minute on a loaded 2-core machine), well under the timeout: the
    # kill is noticed when it happens, not when the others' collectives time out
    assert elapsed < 100, elapsed
    time.sleep(0.5)
    assert workers_alive(plan_file) == []


@pytest.mark.slow
def test_multi_node_cluster_prints_node_commands(tmp_path: Path) -> None:
    plan = hetsynth.plan("gpt:tiny", cluster=load_cluster(CLUSTERS / "a100-t4.toml"))
    path = tmp_path / "p.json"
    hetsynth.save_plan(plan, path)
    out = hetsynth_cli("run", str(path), "--steps", "2")
    assert out.returncode == 0
    assert out.stdout.count("torchrun --nnodes 2") == 1 and "--node-rank 1" in out.stdout
    # node 0 hosts the store through the agent that binds it to the address given only
    node0 = next(line for line in out.stdout.splitlines() if "--node-rank 0" in line)
    assert "python -m hetsynth.runtime.agent --bind-store -- --nnodes 2" in node0


def test_a_node_command_agent_parses_without_a_launcher() -> None:
    """The printed node-0 command's agent: no --parent (nothing to die with), no --failures."""
    from torch.distributed.run import parse_args

    from hetsynth.runtime import agent

    argv = ["--bind-store", "--", "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1",
            "--master-addr", "127.0.0.1", "--master-port", "0", "-m", "hetsynth.runtime.worker"]
    args = agent.parse(argv)
    assert args.parent is None and args.failures is None and args.bind_store
    torchrun = parse_args(args.torchrun[1:])
    assert torchrun.master_addr == "127.0.0.1" and torchrun.nnodes == "2"


@pytest.mark.slow
def test_explain_prints_program_and_shards(plan_file: str) -> None:
    out = hetsynth_cli("explain", plan_file, "--rank", "3")
    assert out.returncode == 0, out.stderr
    assert "rank 3 of 4" in out.stdout and "def forward(self, tokens, targets)" in out.stdout
    assert "shard table:" in out.stdout and "slice starts" in out.stdout
    bad = hetsynth_cli("explain", plan_file, "--rank", "9")
    assert bad.returncode == 2 and "0..3" in bad.stderr
