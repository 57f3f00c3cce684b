"""`hetsynth run`: launch a plan with torchrun, on this machine or as per-node commands.

- A single-node cluster runs here: `torchrun --standalone` with one process per device (gloo
  on CPU, NCCL on GPUs).
- A cluster with an `emulation` section runs here on the emulated cluster
  (runtime.emulation): one torchrun per node, each inside its node's network namespace, with
  static rendezvous at node 0's address; each worker joins its device's cgroup. Without
  root, plain local processes run instead (correctness only) and a note says so.
- Any other multi-node cluster: the torchrun command for each node is printed.

Every node's torchrun runs as an agent (runtime.agent: torchrun that dies with the launcher,
records its workers' failures, and on node 0 keeps the rendezvous store up until the other
agents have left) in its own process session, and its output is streamed. Every rank keeps a
status file with a heartbeat (runtime.heartbeat); the launcher watches them and the agents:
when a rank fails, dies, or stops beating for the timeout, the agents get SETTLE_S to stop by
themselves, then everything is killed and one rank is named with its own error message, or
as stopped / killed by a signal. A stuck rank ends the run within the collective timeout
(every process group has it) plus a few seconds, however torchrun handles the stopped process.
What a run creates (work directory, agent sessions, the emulated cluster) is recorded first
(runtime.runstate) and removed at the end, on errors, Ctrl-C and SIGTERM, or by the next
`hetsynth` command after a SIGKILL.

`check` also trains the plain single-device model with the same initialisation, data and
optimizer and compares the loss of every step and the final parameters.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from cost_models.cluster import ClusterSpec
from hetsynth.models import parse_model_ref
from instruction_set.plan import Plan, save_plan
from runtime import emulation, heartbeat, runstate
from runtime.checkpoint import check_resume, read_checkpoint
from runtime.outputs import check_outputs
from runtime.runstate import RunRecord
from runtime.train import TrainConfig, reference_training


@dataclass
class RunOptions:
    steps: int = 20
    optimizer: str = "adamw"
    lr: float = 1e-3
    max_grad_norm: float = 1.0
    timeout_s: float = 60.0
    check: bool = False
    tolerance: float = 1e-6
    save: str | None = None
    resume: str | None = None
    report: str | None = None
    quiet: bool = False
    trace_raw: str | None = None   # directory for the ranks' raw instruction times (runtime.timing)
    trace_steps: int = 1           # the last N steps are traced

    def train_config(self) -> TrainConfig:
        return TrainConfig(steps=self.steps, optimizer=self.optimizer, lr=self.lr, max_grad_norm=self.max_grad_norm)


def preflight(plan: Plan, opts: RunOptions) -> None:
    """What can be checked before any rank starts: the numbers, the output paths (nothing
    trains for a file that cannot be written) and the checkpoint to resume from. Raises
    ValueError (`error: ...`, exit 2)."""
    if opts.steps < 1:
        raise ValueError(f"--steps {opts.steps}: give at least 1")
    if not (math.isfinite(opts.timeout_s) and opts.timeout_s > 0):
        raise ValueError(f"--timeout {opts.timeout_s:g}: give a positive number of seconds")
    if opts.trace_raw is not None and not 1 <= opts.trace_steps < opts.steps:
        raise ValueError(f"--trace-steps {opts.trace_steps} with --steps {opts.steps}: trace at least 1 step "
                         f"and leave at least 1 step before them to warm up (--steps > --trace-steps)")
    check_outputs({"--save": opts.save, "--report": opts.report})
    if opts.resume:
        check_resume(read_checkpoint(opts.resume), opts.resume, plan, opts.train_config(), opts.steps)


def runs_here(cluster: ClusterSpec) -> bool:
    return len(cluster.nodes) == 1 or cluster.emulation is not None


def worker_args(plan_path: str, opts: RunOptions, report: str, params_out: str | None) -> list[str]:
    args = ["-m", "runtime.worker", "--plan", plan_path, "--steps", str(opts.steps),
            "--optimizer", opts.optimizer, "--lr", str(opts.lr), "--max-grad-norm", str(opts.max_grad_norm),
            "--timeout", str(opts.timeout_s), "--report", report]
    args += ["--params-out", params_out] if params_out else []
    args += ["--save", opts.save] if opts.save else []
    args += ["--resume", opts.resume] if opts.resume else []
    args += ["--trace-raw", opts.trace_raw, "--trace-steps", str(opts.trace_steps)] if opts.trace_raw else []
    return args + (["--quiet"] if opts.quiet else [])


def node_commands(plan: Plan, plan_path: str, opts: RunOptions) -> list[str]:
    """One torchrun command per node of a multi-node cluster."""
    n = len(plan.cluster.nodes)
    out = []
    for i, node in enumerate(plan.cluster.nodes):
        args = " ".join(worker_args(plan_path, opts, "report.json", None))
        out.append(f"# node {node.name} ({len(node.devices)} devices)\n"
                   f"torchrun --nnodes {n} --node-rank {i} --nproc-per-node {len(node.devices)} "
                   f"--master-addr <address of node {plan.cluster.nodes[0].name}> --master-port 29500 {args}")
    return out


class RunFailed(RuntimeError):
    """A launched run failed; the message names the rank and carries its own error."""


@dataclass
class Failure:
    rank: int | None
    why: str

    def __str__(self) -> str:
        return f"rank {self.rank} failed: {self.why}" if self.rank is not None else self.why


BASE_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
SETTLE_S = 2.0      # after a failure is found, how long the agents get to stop by themselves
WATCHDOG_S = 2.0    # a rank without a heartbeat for timeout + this is stopped by the launcher
POLL_S = 0.1


@contextmanager
def recorded_run() -> Iterator[tuple[RunRecord, Path]]:
    """A run state record (runtime.runstate) and a recorded work directory; on the way out
    (errors, Ctrl-C and SIGTERM included) everything recorded is removed."""
    handlers = emulation.exit_on_signals()
    record = RunRecord.open()
    try:
        yield record, runstate.tempdir(record, "hetsynth-run-")
    finally:
        try:
            runstate.remove(record.created)
            record.close()
        finally:
            emulation.restore_signals(handlers)


def launch(cluster: ClusterSpec, module_args: list[str], *, timeout_s: float = 900.0) -> tuple[int, Failure | None]:
    """Run `python <module_args>` on every device of a cluster that runs here; returns (exit
    status, the failure: the rank named and its own message). Emulated when the spec asks
    and root allows. `timeout_s`: the workers' collective timeout (the launcher stops a rank
    whose heartbeat stops for that long plus WATCHDOG_S)."""
    with recorded_run() as (record, workdir):
        return launch_in(record, workdir, cluster, module_args, timeout_s=timeout_s)


def launch_in(record: RunRecord, workdir: Path, cluster: ClusterSpec, module_args: list[str], *,
              timeout_s: float) -> tuple[int, Failure | None]:
    """launch() inside a recorded run and its work directory."""
    status = workdir / "status"
    status.mkdir()
    env = os.environ | BASE_ENV | {heartbeat.ENV: str(status)}
    torchrun = ["--monitor-interval=0.5", *module_args]
    if cluster.emulation is not None and len(cluster.nodes) > 1:
        reason = emulation.unavailable()
        if reason is None:
            with emulation.Emulation(cluster, record=record) as emu:
                env |= {"GLOO_SOCKET_IFNAME": emulation.IFACE, emulation.ENV: emu.rank_env()}
                agents = [_start(record, workdir, i, emu.in_node(i, _agent(workdir, i, [
                    f"--nnodes={len(cluster.nodes)}", f"--node-rank={i}", f"--nproc-per-node={len(node.devices)}",
                    f"--master-addr={emu.address(0)}", "--master-port=29500", *torchrun], hold_store=i == 0)), env)
                    for i, node in enumerate(cluster.nodes)]
                return supervise(record, agents, workdir, cluster.num_devices, timeout_s)
        print(f"note: not emulating {cluster.name!r} ({reason}); running unshaped local processes "
              f"(correct results, no link shaping or CPU quotas)", flush=True)
    agent = _start(record, workdir, 0, _agent(workdir, 0, ["--standalone", f"--nproc-per-node={cluster.num_devices}",
                                                        *torchrun]), env)
    return supervise(record, [agent], workdir, cluster.num_devices, timeout_s)


def launch_checked(cluster: ClusterSpec, module_args: list[str], what: str, *, timeout_s: float = 900.0) -> None:
    """launch(), raising RunFailed(`<what> failed: rank N failed: <its error>`) when it fails."""
    rc, failure = launch(cluster, module_args, timeout_s=timeout_s)
    if rc != 0:
        raise RunFailed(f"{what} failed: {failure or f'exit status {rc}'}")


def _agent(workdir: Path, node: int, torchrun: list[str], hold_store: bool = False) -> list[str]:
    return [sys.executable, "-m", "runtime.agent", "--parent", str(os.getpid()),
            "--failures", str(workdir / f"failures{node}.json"), *(["--hold-store"] if hold_store else []),
            "--", *torchrun]


def _start(record: RunRecord, workdir: Path, node: int, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start an agent in its own session (its process group is recorded: a dead launcher's
    agents and workers are killed by the next command; they also get SIGTERM at once from
    PR_SET_PDEATHSIG, runtime.agent)."""
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    record.add("session", f"{proc.pid}:{runstate.start_ticks(proc.pid)}")
    return proc


def _echo(proc: subprocess.Popen) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()


def supervise(record: RunRecord, agents: list[subprocess.Popen], workdir: Path, world_size: int,
              timeout_s: float) -> tuple[int, Failure | None]:
    """Echo the agents' output and wait for them; when something goes wrong (an agent or a
    rank fails, a rank dies, a rank's heartbeat stops for the timeout), give the agents
    SETTLE_S to stop by themselves, name the rank (runtime.heartbeat.diagnose) and kill what
    is left. Every rank's process is recorded in `record` as soon as its status file appears.
    Returns (exit status, failure)."""
    threads = [threading.Thread(target=_echo, args=(a,), daemon=True) for a in agents]
    for t in threads:
        t.start()
    found_at = _wait(record, agents, workdir / "status", timeout_s)
    failure = None
    if found_at is not None:
        signals = _signals(workdir)
        found = heartbeat.diagnose(heartbeat.read_status(workdir / "status"), found_at, world_size=world_size,
                                   timeout_s=timeout_s, signals=signals)
        failure = Failure(found.rank, found.why) if found else _agent_failure(agents, workdir)
    for agent in agents:
        _kill_session(agent)
    _kill_ranks(heartbeat.read_status(workdir / "status"))
    for t in threads:
        t.join(timeout=5)
    codes = [a.returncode for a in agents]
    return (0, None) if found_at is None else (next((c for c in codes if c and c > 0), 1), failure)


def _wait(record: RunRecord, agents: list[subprocess.Popen], status: Path, timeout_s: float) -> float | None:
    """Wait until every agent succeeded (None) or something went wrong (the time it was
    found, after SETTLE_S for the agents to stop)."""
    found_at, seen = None, set()
    while True:
        codes = [a.poll() for a in agents]
        now, statuses = time.time(), heartbeat.read_status(status)
        for s in statuses.values():
            if _session(s) not in seen:
                seen.add(_session(s))
                record.add("session", _session(s))
        if found_at is None and all(c == 0 for c in codes):
            return None
        if found_at is None and _trouble(codes, statuses, now, timeout_s):
            found_at = now
        if found_at is not None and (all(c is not None for c in codes) or now - found_at >= SETTLE_S):
            return found_at
        if len(agents) > 1 and all(c == 0 for c in codes[1:]) and agents[0].stdin and not agents[0].stdin.closed:
            agents[0].stdin.close()  # node 0's agent may now let the rendezvous store go (runtime.agent)
        time.sleep(POLL_S)


def _trouble(codes: list[int | None], statuses: dict[int, heartbeat.RankStatus], now: float, timeout_s: float) -> bool:
    if any(c not in (None, 0) for c in codes) or any(s.state == "failed" for s in statuses.values()):
        return True
    gone = any(s.state == "running" and heartbeat.process_state(s.pid, s.start) is None for s in statuses.values())
    return gone or bool(heartbeat.stalled(statuses, now, timeout_s + WATCHDOG_S))


def _signals(workdir: Path) -> dict[int, str]:
    """rank -> signal name of the workers the agents saw end by a signal."""
    out = {}
    for path in workdir.glob("failures*.json"):
        for rank, fail in json.loads(path.read_text()).items():
            if fail["signal"]:
                out[int(rank)] = fail["signal"]
    return out


def _agent_failure(agents: list[subprocess.Popen], workdir: Path) -> Failure:
    """When no rank can be named from the status files (a rank failed before it started its
    heartbeat): the agents' own records."""
    for path in sorted(workdir.glob("failures*.json")):
        for rank, fail in sorted(json.loads(path.read_text()).items(), key=lambda kv: int(kv[0])):
            return Failure(int(rank), f"exit code {fail['exitcode']} before it started (see its output above)")
    codes = [a.poll() for a in agents]
    return Failure(None, f"an agent exited with status {next((c for c in codes if c), None)}")


def _kill_ranks(statuses: dict[int, heartbeat.RankStatus]) -> None:
    """torchrun starts every worker in a session of its own: a worker its agent could not
    stop (a stopped process ignores SIGTERM until continued) outlives the agent's session."""
    for s in statuses.values():
        runstate.kill_session(_session(s))


def _session(status: heartbeat.RankStatus) -> str:
    return f"{status.pid}:{status.start}"


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def check_against_single_device(plan: Plan, opts: RunOptions, workdir: str) -> int:
    spec = parse_model_ref(plan.model.ref)
    losses, params = reference_training(spec, plan.model.batch_size, opts.train_config())
    report = json.loads(Path(opts.report or os.path.join(workdir, "report.json")).read_text())
    got = torch.load(os.path.join(workdir, "params.pt"), weights_only=False)
    expected = losses[report.get("first_step", 0):]  # a resumed run reports the steps after its checkpoint
    loss_err = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(report["losses"], expected))
    param_err = max(float((got[k] - params[k]).abs().max()) if got[k].numel() else 0.0 for k in got)
    ok = loss_err <= opts.tolerance and param_err <= opts.tolerance
    print(f"check: largest relative loss difference {loss_err:.3e}, largest parameter difference "
          f"{param_err:.3e} (tolerance {opts.tolerance:g}): {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def run(plan: Plan, plan_path: str | None, opts: RunOptions) -> int:
    """Train `plan` (saved at `plan_path`, or None: it is saved in the run's work directory)."""
    if not runs_here(plan.cluster):
        print("\n\n".join(node_commands(plan, plan_path or "plan.json", opts)))
        return 0
    preflight(plan, opts)
    started = time.monotonic()
    with recorded_run() as (record, workdir):
        if plan_path is None:
            plan_path = str(workdir / "plan.json")
            save_plan(plan, plan_path)
        report = opts.report or str(workdir / "report.json")
        params_out = str(workdir / "params.pt") if opts.check else None
        rc, failure = launch_in(record, workdir, plan.cluster, worker_args(plan_path, opts, report, params_out),
                                timeout_s=opts.timeout_s)
        if rc != 0:
            print(f"hetsynth run: {failure or f'exit status {rc}'}; the other ranks were stopped "
                  f"({time.monotonic() - started:.1f} s after the start)", file=sys.stderr)
            return rc
        return check_against_single_device(plan, opts, str(workdir)) if opts.check else 0
