"""Faults during `hetsynth run`, each under a hard outer timeout: a SIGSTOPped rank (two-level
plan on the emulated cluster when root, and a single-level plan) ends the run within the
collective timeout plus a few seconds, naming that rank; a rank's own error is the failure
line; a SIGKILLed `hetsynth run` leaves nothing once any other hetsynth command has run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hetsynth
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.runtime import heartbeat
from hetsynth.runtime.emulation import leftovers
from hetsynth.runtime.names import stat_fields
from hetsynth.runtime.runstate import state_dir

# multi-process or seconds long: make test runs them, make test-fast does not
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = load_cluster(ROOT / "configs" / "clusters" / "local-emulated.toml")


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The default plan of GPT tiny on the emulated cluster (two-level), and one on its
    first node's two devices (single-level)."""
    d = tmp_path_factory.mktemp("faults")
    out = {}
    for name, cluster in (("two-level", CLUSTER), ("single-level", CLUSTER.first(2))):
        hetsynth.save_plan(hetsynth.plan("gpt:tiny", cluster=cluster), d / f"{name}.json")
        out[name] = str(d / f"{name}.json")
    return out


def start(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hetsynth", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=os.environ | (env or {}))


def wait_for(proc: subprocess.Popen, text: str, timeout_s: float = 120) -> str:
    """Read the output until a line holds `text`; returns what was read."""
    seen, deadline = [], time.monotonic() + timeout_s
    for line in proc.stdout:
        seen.append(line)
        if text in line or time.monotonic() > deadline:
            break
    assert text in "".join(seen), "".join(seen)
    return "".join(seen)


def rank_pid(plan: str, rank: int) -> int:
    """The pid of the worker process of `rank` training `plan`."""
    ranks = heartbeat.run_ranks(plan)
    assert rank in ranks, f"no worker of rank {rank} for {plan}: {ranks}"
    return ranks[rank].pid


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape, timeout_s", [("two-level", 10), ("single-level", 6)])
def test_stopped_rank_is_named_within_the_timeout(plans: dict[str, str], shape: str, timeout_s: int) -> None:
    proc = start("run", plans[shape], "--steps", "1000", "--timeout", str(timeout_s))
    try:
        wait_for(proc, "step    2/")
        os.kill(rank_pid(plans[shape], 1), signal.SIGSTOP)
        stopped = time.monotonic()
        out = proc.communicate(timeout=timeout_s + 60)[0]
        took = time.monotonic() - stopped
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "hetsynth run: rank 1 failed: stopped making progress" in out, out[-3000:]
    assert took < timeout_s + 20, took  # 30 s for --timeout 10
    assert "Traceback" not in out


@pytest.mark.timeout(120)
def test_rank_error_is_the_failure_line(plans: dict[str, str]) -> None:
    """Rank 1 raises; its peers then fail on broken connections: rank 1 and its message are named."""
    out = subprocess.run([sys.executable, "-m", "hetsynth", "run", plans["single-level"], "--steps", "5"],
                         capture_output=True, text=True, cwd=ROOT, timeout=100,
                         env=os.environ | {"HETSYNTH_FAULT": "1:1:raise"})
    assert out.returncode == 1
    assert "hetsynth run: rank 1 failed: InjectedFault: injected fault at step 1" in out.stderr, out.stderr[-3000:]


@pytest.mark.timeout(120)
def test_rank_checks_its_output_paths_before_training(plans: dict[str, str]) -> None:
    """The ranks check --save themselves (the per-node commands of a multi-node cluster skip
    the launcher's checks): the launcher's failure line carries rank 0's message, no step ran."""
    from hetsynth.runtime.config import TrainConfig
    from hetsynth.runtime.launch import RunOptions, launch, worker_args

    opts = RunOptions(train=TrainConfig(steps=3), save="/proc/ck.pt")
    rc, failure = launch(CLUSTER.first(2), worker_args(plans["single-level"], opts, "/dev/null", None), timeout_s=30)
    assert rc != 0 and failure is not None and failure.rank == 0
    assert "--save '/proc/ck.pt': cannot write" in failure.why, failure


def _run_state(pid: int) -> dict:
    for _ in range(600):
        files = list(state_dir().glob(f"{pid}-*.json"))
        if files and "session" in files[0].read_text():
            return json.loads(files[0].read_text())
        time.sleep(0.1)
    raise AssertionError(f"no run state of pid {pid}")


def _gone(kind: str, name: str) -> bool:
    if kind in ("tempdir", "cgroup"):
        return not Path(name).exists()
    if kind == "session":
        pid, start = name.split(":")
        fields = stat_fields(int(pid))
        return fields is None or fields[19] != start or fields[0] == "Z"
    found = leftovers()
    return name not in found["namespaces"] + found["veths"]


@pytest.mark.timeout(180)
@pytest.mark.serial  # any command on the machine may clean up the dead launcher's emulation first
def test_killed_launcher_leaves_nothing_after_the_next_command(plans: dict[str, str]) -> None:
    proc = start("run", plans["two-level"], "--steps", "1000")
    try:
        wait_for(proc, "step    1/")
        state = _run_state(proc.pid)
        proc.kill()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert not all(_gone(k, n) for k, n in state["created"])  # something to clean up
    out = subprocess.run([sys.executable, "-m", "hetsynth", "inspect", "--cluster", str(ROOT / "configs" / "clusters"
                          / "a100-t4.toml")], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and f"removed what a dead run (pid {proc.pid}) left" in out.stderr, out.stderr
    left = [(k, n) for k, n in state["created"] if not _gone(k, n)]
    assert left == [] and not list(state_dir().glob(f"{proc.pid}-*.json"))
    if any(k == "netns" for k, _ in state["created"]):
        assert not any(str(proc.pid) in n for names in leftovers().values() for n in names)
