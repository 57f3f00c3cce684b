"""`hetsynth run` and `hetsynth launch`: a plan's ranks under torchrun, on this machine or as
per-node commands. Both go one way (`_launched`, `node_commands`); only the worker's command
line differs: runtime.worker training the plan (`run`), or the user's script under
runtime.script_runner (`run_script`). Every rank finds the validated plan file's absolute
path in HETSYNTH_PLAN (runtime.plan_handoff.PATH_ENV).

- A single-node cluster runs here: torchrun with one process per device (gloo on CPU, NCCL
  on GPUs), its rendezvous store (no authentication) and the process groups' sockets on
  loopback only (static rendezvous at 127.0.0.1, a free port; GLOO_ and
  NCCL_SOCKET_IFNAME=lo). Not `--standalone`: its stores listen on every interface.
- A cluster with an `emulation` section, one node or more, runs here on the emulated cluster
  (runtime.emulation): one torchrun per node, each inside its node's network namespace, with
  static rendezvous at node 0's address (its store listens there only); each worker joins
  its device's cgroup. Without root, plain local processes run instead (correctness only)
  and a note says so (a one-node emulated cluster too: as plain local processes its devices
  would compute at a whole CPU each, not at their quotas).
- Any other multi-node cluster: the torchrun command for each node is printed, with the
  addresses and interface left for the user to fill in.

torchrun's own log directories go under the run's work directory (`--log-dir`), not
/tmp/torchelastic_*, and go with it. The ranks get the sha256 of the plan file the launcher
validated (runtime.plan_handoff) and refuse a file that changed since.

Every node's torchrun runs as an agent (runtime.agent: torchrun that dies with the launcher,
records its workers' failures, and on node 0 keeps the rendezvous store up until the other
agents have left) in its own process session, and its output is streamed. Every rank keeps a
status file with a heartbeat (runtime.heartbeat); the launcher watches them and the agents:
when a rank fails, dies, or stops beating for the timeout, the agents get SETTLE_S to stop by
themselves (up to SETTLE_MAX_S while a rank's process is gone that no agent has recorded yet),
then everything is killed and one rank is named with its own error message, or
as stopped / killed by a signal. A stuck rank ends the run within the collective timeout
(every process group has it) plus a few seconds, however torchrun handles the stopped process.
What a run creates (work directory, agent sessions, the emulated cluster) is recorded first
(runtime.runstate) and removed at the end, on errors, Ctrl-C and SIGTERM, or by the next
`hetsynth` command after a SIGKILL.

With emulated device memory (the spec's `emulation.memory_scale`), a rank the kernel's OOM
killer ended in its memory group is named as out of memory with its limit and peak, whatever
the other ranks reported about its going (a closed connection is a consequence); every rank's
measured peak (the group's `memory.max_usage_in_bytes`) is logged and written to the work
directory's MEMORY_FILE as {rank: {"limit_bytes", "peak_bytes", "failcnt", "oom_kills"}}.

`check` also runs the plan's float64 twin and trains the plain single-device model in both
dtypes, comparing the loss of every step and the final parameters and buffers (runtime.check);
a resumed run is compared with single-device training resumed from the same checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shlex
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

from hetsynth.instruction_set.cluster import ClusterSpec
from hetsynth.instruction_set.plan import Plan, PlanShape, save_plan
from hetsynth.instruction_set.precision import lowered_ops_recorded
from hetsynth.runtime import emulation, heartbeat, runstate
from hetsynth.runtime.check import Comparison, compare, dtype_tolerances, lowest_dtype
from hetsynth.runtime.checkpoint import check_resume, read_checkpoint
from hetsynth.runtime.config import TrainConfig
from hetsynth.runtime.outputs import check_outputs
from hetsynth.runtime.pipeline.run import check_pipeline_args
from hetsynth.runtime.plan_handoff import PATH_ENV, PLAN_ENV, validated_digest
from hetsynth.runtime.runstate import RunRecord
from hetsynth.runtime.run_errors import RunFailed
from hetsynth.runtime.memory_report import format_cgroup_peaks
from hetsynth.runtime.names import process_state
from hetsynth.runtime.mixed_precision import reference_dtype
from hetsynth.runtime.train import plan_reference

log = logging.getLogger(__name__)


@dataclass
class RunOptions:
    """How to run a plan: the training (`train`) and the run around it."""

    train: TrainConfig = TrainConfig()
    timeout_s: float = 60.0
    check: bool = False
    tolerance: float = 1e-9  # float64 check: relative loss; parameters and buffers 10x
    save: str | None = None
    resume: str | None = None
    report: str | None = None
    quiet: bool = False
    trace_raw: str | None = None   # directory for the ranks' raw instruction times (runtime.timing)
    trace_steps: int = 1           # the last N steps are traced
    memory_report: bool = False    # measure each rank's memory in the second step (runtime.memory_report)

    @property
    def steps(self) -> int:
        return self.train.steps


def preflight(plan: Plan, opts: RunOptions) -> None:
    """What can be checked before any rank starts: the numbers, the output paths (nothing
    trains for a file that cannot be written) and the checkpoint to resume from. Raises
    ValueError (`error: ...`, exit 2)."""
    if opts.steps < 1:
        raise ValueError(f"--steps {opts.steps}: give at least 1")
    check_timeout(opts.timeout_s)
    if opts.trace_raw is not None and not 1 <= opts.trace_steps < opts.steps:
        raise ValueError(f"--trace-steps {opts.trace_steps} with --steps {opts.steps}: trace at least 1 step "
                         f"and leave at least 1 step before them to warm up (--steps > --trace-steps)")
    if opts.memory_report and opts.steps < 2:
        raise ValueError(f"--memory-report with --steps {opts.steps}: the second step is measured (the first "
                         f"creates the optimizer state); give --steps 2 or more")
    if plan.shape is PlanShape.PIPELINE:
        check_pipeline_args(opts)
    check_outputs({"--save": opts.save, "--report": opts.report})
    if opts.resume:
        check_resume(read_checkpoint(opts.resume), opts.resume, plan, opts.train, opts.steps)


def check_timeout(timeout_s: float) -> None:
    """ValueError unless `timeout_s` (--timeout) is a positive number of seconds."""
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"--timeout {timeout_s:g}: give a positive number of seconds")


def runs_here(cluster: ClusterSpec) -> bool:
    return len(cluster.nodes) == 1 or cluster.emulation is not None


def worker_args(plan_path: str, opts: RunOptions, report: str, params_out: str | None,
                dtype: str | None = None) -> list[str]:
    train = dataclasses.replace(opts.train, dtype=dtype) if dtype else opts.train
    args = ["-m", "hetsynth.runtime.worker", "--plan", plan_path, *train.to_argv(),
            "--timeout", str(opts.timeout_s), "--report", report]
    args += ["--params-out", params_out] if params_out else []
    args += ["--save", opts.save] if opts.save else []
    args += ["--resume", opts.resume] if opts.resume else []
    args += ["--trace-raw", opts.trace_raw, "--trace-steps", str(opts.trace_steps)] if opts.trace_raw else []
    args += ["--memory-report"] if opts.memory_report else []
    return args + (["--quiet"] if opts.quiet else [])


def script_args(script: str, args: list[str]) -> list[str]:
    """The worker's command line of `hetsynth launch`: the user's script and its arguments,
    untouched, under runtime.script_runner."""
    return ["-m", "hetsynth.runtime.script_runner", script, *args]


def node_commands(cluster: ClusterSpec, worker: list[str], env: dict[str, str] | None = None) -> str:
    """One torchrun command per node of a multi-node cluster, running `python <worker>` with
    `env` in front; the addresses and gloo's interface (the network the nodes share,
    GLOO_SOCKET_IFNAME) are the user's to fill in. Node 0's torchrun runs as runtime.agent with
    --bind-store, so that the rendezvous store (no authentication) listens on the address given
    there only, not on every interface."""
    n, first = len(cluster.nodes), cluster.nodes[0].name
    args = shlex.join(worker)
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in (env or {}).items())
    out = []
    for i, node in enumerate(cluster.nodes):
        torchrun = "python -m hetsynth.runtime.agent --bind-store -- " if i == 0 else "torchrun "
        out.append(f"# node {node.name} ({len(node.devices)} devices)\n{prefix}"
                   f"GLOO_SOCKET_IFNAME=<interface of node {node.name} toward node {first}> "
                   f"{torchrun}--nnodes {n} --node-rank {i} --nproc-per-node {len(node.devices)} "
                   f"--master-addr <address of node {first} on that network> --master-port 29500 {args}")
    return "\n\n".join(out)


@dataclass
class Failure:
    rank: int | None
    why: str

    def __str__(self) -> str:
        return f"rank {self.rank} failed: {self.why}" if self.rank is not None else self.why


BASE_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
LOOPBACK = "127.0.0.1"  # where the store of a run on this machine listens
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}  # and its process groups' sockets
SETTLE_S = 2.0      # after a failure is found, how long the agents get to stop by themselves
SETTLE_MAX_S = 10.0  # ... and how long, at most, while a rank's process is gone and no agent has recorded it
WATCHDOG_S = 2.0    # a rank without a heartbeat for timeout + this is stopped by the launcher
POLL_S = 0.1
MEMORY_FILE = "memory.json"  # in the work directory: the emulated ranks' memory groups (module docstring)
MIB = 2**20


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


def launch(cluster: ClusterSpec, module_args: list[str], *, timeout_s: float = 900.0,
           plans: dict[str, str] | None = None) -> tuple[int, Failure | None]:
    """Run `python <module_args>` on every device of a cluster that runs here; returns (exit
    status, the failure: the rank named and its own message). Emulated when the spec asks
    and root allows. `timeout_s`: the workers' collective timeout (the launcher stops a rank
    whose heartbeat stops for that long plus WATCHDOG_S). `plans`: plan path -> the sha256
    its ranks must find (runtime.plan_handoff)."""
    with recorded_run() as (record, workdir):
        return launch_in(record, workdir, cluster, module_args, timeout_s=timeout_s, plans=plans)


def launch_in(record: RunRecord, workdir: Path, cluster: ClusterSpec, module_args: list[str], *,
              timeout_s: float, plans: dict[str, str] | None = None,
              env: dict[str, str] | None = None) -> tuple[int, Failure | None]:
    """launch() inside a recorded run and its work directory; `env`: more for the workers."""
    status = workdir / "status"
    status.mkdir()
    env = (os.environ | BASE_ENV | {heartbeat.ENV: str(status)} | ({PLAN_ENV: json.dumps(plans)} if plans else {})
           | (env or {}))
    torchrun = ["--monitor-interval=0.1", *module_args]  # the agent sees its workers end within 0.1 s
    if cluster.emulation is not None:
        reason = emulation.unavailable()
        if reason is None:
            return _emulated(record, workdir, cluster, torchrun, env, timeout_s)
        log.warning("note: not emulating %r (%s); running unshaped local processes (correct results, no "
                    "link shaping or CPU quotas)", cluster.name, reason)
    local = ["--nnodes=1", "--node-rank=0", f"--nproc-per-node={cluster.num_devices}", f"--master-addr={LOOPBACK}",
             "--master-port=0", *torchrun]
    agent = _start(record, workdir, 0, _agent(workdir, 0, local, "--bind-store"), env | LOOPBACK_ENV)
    return supervise(record, [agent], workdir, cluster.num_devices, timeout_s)


def _emulated(record: RunRecord, workdir: Path, cluster: ClusterSpec, torchrun: list[str], env: dict[str, str],
              timeout_s: float) -> tuple[int, Failure | None]:
    """launch_in() on the emulated cluster: one agent per node in its namespace; node 0's
    hosts the store on its own address (and, with other nodes, holds it: runtime.agent)."""
    n = len(cluster.nodes)
    with emulation.Emulation(cluster, record=record) as emu:
        env = env | {"GLOO_SOCKET_IFNAME": emulation.IFACE} | emu.worker_env()
        agents = [_start(record, workdir, i, emu.in_node(i, _agent(workdir, i, [
            f"--nnodes={n}", f"--node-rank={i}", f"--nproc-per-node={len(node.devices)}",
            f"--master-addr={emu.address(0)}", "--master-port=29500", *torchrun],
            None if i else "--hold-store" if n > 1 else "--bind-store")), env)
            for i, node in enumerate(cluster.nodes)]
        rc, failure = supervise(record, agents, workdir, cluster.num_devices, timeout_s)
        usage = emu.memory_usage()
    if usage:
        (workdir / MEMORY_FILE).write_text(json.dumps(usage))
        log.info("%s", format_memory_usage(usage))
    return rc, (out_of_memory(usage) or failure) if rc != 0 else failure


def out_of_memory(usage: dict[int, dict[str, int]]) -> Failure | None:
    """The lowest rank the OOM killer ended in its memory group, named with its limit."""
    for rank, u in sorted(usage.items()):
        if u["oom_kills"] > 0:
            return Failure(rank, f"out of memory: killed by the OOM killer at its memory limit of "
                                 f"{u['limit_bytes'] / MIB:.0f} MiB (peak {u['peak_bytes'] / MIB:.0f} MiB, "
                                 f"{u['failcnt']} allocations refused at the limit)")
    return None


def format_memory_usage(usage: dict[int, dict[str, int]]) -> str:
    """One line per rank: measured peak against the limit (MiB)."""
    lines = ["measured peak memory per rank (cgroup memory.max_usage_in_bytes, MiB):"]
    lines += [f"  rank {r}: peak {u['peak_bytes'] / MIB:.0f} of {u['limit_bytes'] / MIB:.0f} limit"
              + (" (out of memory)" if u["oom_kills"] else "") for r, u in sorted(usage.items())]
    return "\n".join(lines)


def launch_checked(cluster: ClusterSpec, module_args: list[str], what: str, *, timeout_s: float = 900.0,
                   plans: dict[str, str] | None = None) -> None:
    """launch(), raising RunFailed(`<what> failed: rank N failed: <its error>`) when it fails."""
    rc, failure = launch(cluster, module_args, timeout_s=timeout_s, plans=plans)
    if rc != 0:
        raise RunFailed(f"{what} failed: {failure or f'exit status {rc}'}")


def _agent(workdir: Path, node: int, torchrun: list[str], store: str | None = None) -> list[str]:
    """An agent's command; `store`: --bind-store or --hold-store for the node hosting the
    store. torchrun's logs go under the work directory (not /tmp/torchelastic_*)."""
    return [sys.executable, "-m", "hetsynth.runtime.agent", "--parent", str(os.getpid()),
            "--failures", str(workdir / f"failures{node}.json"), *([store] if store else []),
            "--", f"--log-dir={workdir / f'torchelastic{node}'}", *torchrun]


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
    found_at = _wait(record, agents, workdir, timeout_s)
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


def _wait(record: RunRecord, agents: list[subprocess.Popen], workdir: Path, timeout_s: float) -> float | None:
    """Wait until every agent succeeded (None) or something went wrong (the time it was
    found, after SETTLE_S for the agents to stop, longer while `_unrecorded`, up to
    SETTLE_MAX_S)."""
    found_at, seen = None, set()
    while True:
        codes = [a.poll() for a in agents]
        now, statuses = time.time(), heartbeat.read_status(workdir / "status")
        for s in statuses.values():
            if _session(s) not in seen:
                seen.add(_session(s))
                record.add("session", _session(s))
        if found_at is None and all(c == 0 for c in codes):
            return None
        if found_at is None and _trouble(codes, statuses, now, timeout_s):
            found_at = now
        if found_at is not None and (all(c is not None for c in codes) or now - found_at >= SETTLE_MAX_S
                                     or (now - found_at >= SETTLE_S and not _unrecorded(statuses, workdir))):
            return found_at
        if len(agents) > 1 and all(c == 0 for c in codes[1:]) and agents[0].stdin and not agents[0].stdin.closed:
            agents[0].stdin.close()  # node 0's agent may now let the rendezvous store go (runtime.agent)
        time.sleep(POLL_S)


def _trouble(codes: list[int | None], statuses: dict[int, heartbeat.RankStatus], now: float, timeout_s: float) -> bool:
    if any(c not in (None, 0) for c in codes) or any(s.state == "failed" for s in statuses.values()):
        return True
    gone = any(s.state == "running" and process_state(s.pid, s.start) is None for s in statuses.values())
    return gone or bool(heartbeat.stalled(statuses, now, timeout_s + WATCHDOG_S))


def _unrecorded(statuses: dict[int, heartbeat.RankStatus], workdir: Path) -> list[int]:
    """Ranks whose process went away while `running` that no agent's failure record names yet.
    Until its agent records the signal, a killed rank cannot be named as killed (heartbeat.died)
    and its peers' closed connections would be named instead; on a loaded machine its agent
    may take longer than SETTLE_S to see it go (measured: a pipeline rank's SIGKILL, 3 xdist
    workers on 2 cores)."""
    recorded = _failure_records(workdir)
    return [s.rank for s in statuses.values()
            if s.state == "running" and s.rank not in recorded and process_state(s.pid, s.start) is None]


def _failure_records(workdir: Path) -> dict[int, dict]:
    """rank -> the record its agent wrote when the worker failed (runtime.agent: exitcode,
    signal), from every node's failures<node>.json, ranks in order."""
    records = {int(rank): fail for path in workdir.glob("failures*.json")
               for rank, fail in json.loads(path.read_text()).items()}
    return dict(sorted(records.items()))


def _signals(workdir: Path) -> dict[int, str]:
    """rank -> signal name of the workers the agents saw end by a signal."""
    return {rank: fail["signal"] for rank, fail in _failure_records(workdir).items() if fail["signal"]}


def _agent_failure(agents: list[subprocess.Popen], workdir: Path) -> Failure:
    """When no rank can be named from the status files (a rank failed before it started its
    heartbeat): the agents' own records."""
    for rank, fail in _failure_records(workdir).items():
        return Failure(rank, f"exit code {fail['exitcode']} before it started (see its output above)")
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


def _compare(plan: Plan, opts: RunOptions, report: str, params: str, dtype: str) -> Comparison:
    """One run against single-device training in `dtype`, from the initialisation or, for a
    resumed run, from the same checkpoint (both cast to `dtype`)."""
    config = dataclasses.replace(opts.train, dtype=dtype if dtype != plan.model.dtype else None)
    run = json.loads(Path(report).read_text())
    with lowered_ops_recorded() as lowered:  # ops without a `dtype` kernel (runtime.check)
        losses, expected = plan_reference(plan, config, read_checkpoint(opts.resume) if opts.resume else None)
    own = config.dtype is None  # the plan's own run (a twin has no policy)
    half = reference_dtype(plan) if own else None  # the policy's stand-in on one device
    autocast = str(half).removeprefix("torch.") if half is not None else ""
    reduce = plan.precision_policy().reduce_dtype if own else "float32"
    rounded = {"gradient reduction": reduce} if reduce != "float32" else {}  # sums rounded to it in the run
    judged = lowest_dtype(autocast or dtype, rounded)
    tolerances = dtype_tolerances(judged, opts.train.optimizer, opts.train.lr, opts.steps - run.get("first_step", 0),
                                  opts.tolerance, lowered)
    policy = plan.precision_policy().describe() if judged != dtype or autocast else ""
    return compare(dtype, run["losses"], losses, torch.load(params, weights_only=False), expected, tolerances,
                   lowered, policy, judged if policy else "", autocast, plan.graph.custom_backwards)


@dataclass(frozen=True)
class RunResult:
    """What `run` did; the caller decides what to print. `failure` says why the run (or the
    float64 twin of --check) stopped; `comparisons` holds --check's figures, the last one decides;
    `node_commands` is set instead when the plan's ranks run elsewhere."""

    rc: int
    failure: str | None = None
    comparisons: tuple[Comparison, ...] = ()
    node_commands: str | None = None

    @property
    def checked(self) -> Comparison | None:
        return self.comparisons[-1] if self.comparisons else None


def _train(plan: Plan, plan_path: str, opts: RunOptions, record: RunRecord, workdir: Path,
           dtype: str | None, digest: str, twin: str | None = None) -> tuple[RunResult, str, str]:
    """One run of the plan (in `dtype`, None: as planned) in its own directory under the run's
    work directory, its ranks held to the plan file's `digest`; (its result, report,
    parameters and buffers). `twin`: the same ranks then train the plan's twin in that dtype
    (worker --twin), whose report and parameters go where `_train(..., dtype=twin)` puts them."""
    tag = dtype or "plan"
    (workdir / tag).mkdir()
    own_report, params_out = _outputs(workdir, tag)
    report = opts.report if opts.report and dtype is None else own_report
    run_opts = opts if dtype is None else dataclasses.replace(opts, save=None, quiet=True,
                                                              memory_report=False)
    worker = worker_args(plan_path, run_opts, report, params_out if opts.check else None, dtype)
    if twin is not None:
        (workdir / twin).mkdir()
        twin_report, twin_params = _outputs(workdir, twin)
        worker += ["--twin", twin, "--twin-report", twin_report, "--twin-params", twin_params]
    return _launched(record, workdir / tag, plan.cluster, worker, opts.timeout_s, plan_path, digest), report, params_out


def _outputs(workdir: Path, tag: str) -> tuple[str, str]:
    """The report and the parameters file of the run tagged `tag` ("plan", or its twin's dtype)."""
    return str(workdir / tag / "report.json"), str(workdir / tag / "params.pt")


def twin_in_the_run(plan: Plan, opts: RunOptions) -> str | None:
    """The dtype of the twin that --check trains in the run's own launch ("float64"), or None:
    no check, a float64 plan (no twin), or --memory-report (the emulated devices' measured peaks
    must be the plan's run alone; the twin then gets a launch of its own). One launch instead of
    two saves a launch's start and end (agents, interpreters, process groups: about 5 s)."""
    if not opts.check or plan.model.dtype == "float64" or opts.memory_report:
        return None
    return "float64"


def _launched(record: RunRecord, workdir: Path, cluster: ClusterSpec, worker: list[str], timeout_s: float,
              plan_path: str, digest: str, env: dict[str, str] | None = None) -> RunResult:
    """`python <worker>` on every rank of `cluster` (launch_in), the ranks held to the plan
    file's `digest` and given its absolute path (PATH_ENV) and `env`; a failure names the rank
    and says when the others were stopped."""
    started = time.monotonic()
    absolute = os.path.abspath(plan_path)
    rc, failure = launch_in(record, workdir, cluster, worker, timeout_s=timeout_s,
                            plans={plan_path: digest, absolute: digest}, env={PATH_ENV: absolute} | (env or {}))
    if rc == 0:
        return RunResult(0)
    why = f"{failure or f'exit status {rc}'}; the other ranks were stopped ({time.monotonic() - started:.1f} s after the start)"
    return RunResult(rc, failure=why)


def _check(plan: Plan, plan_path: str, opts: RunOptions, record: RunRecord, workdir: Path,
           first: tuple[str, str], digest: str, twin_done: bool) -> RunResult:
    """Compare the run as planned (information unless float64) and the float64 twin (decides);
    `twin_done`: the run's own launch trained the twin (twin_in_the_run), else it is launched."""
    results = [_compare(plan, opts, *first, plan.model.dtype)]
    if plan.model.dtype != "float64":
        if twin_done:
            report, params = _outputs(workdir, "float64")
        else:
            log.info("check: running the plan's float64 twin (same program, float64 tensors)")
            twin, report, params = _train(plan, plan_path, opts, record, workdir, "float64", digest)
            if twin.rc != 0:
                return dataclasses.replace(twin, comparisons=tuple(results))
        results.append(_compare(plan, opts, report, params, "float64"))
    return RunResult(0 if results[-1].ok else 1, comparisons=tuple(results))


def run(plan: Plan, plan_path: str | None, opts: RunOptions) -> RunResult:
    """Train `plan` (saved at `plan_path`, or None: it is saved in the run's work directory)."""
    if not runs_here(plan.cluster):
        worker = worker_args(plan_path or "plan.json", opts, "report.json", None)
        return RunResult(0, node_commands=node_commands(plan.cluster, worker))
    preflight(plan, opts)
    with recorded_run() as (record, workdir):
        if plan_path is None:
            plan_path = str(workdir / "plan.json")
            save_plan(plan, plan_path)
        digest = validated_digest(plan, plan_path)
        twin = twin_in_the_run(plan, opts)
        result, report, params = _train(plan, plan_path, opts, record, workdir, None, digest, twin)
        if opts.memory_report and (workdir / "plan" / MEMORY_FILE).exists():
            usage = {int(r): u for r, u in json.loads((workdir / "plan" / MEMORY_FILE).read_text()).items()}
            log.info("%s", format_cgroup_peaks(plan, usage))
        if result.rc != 0 and twin is not None and Path(params).exists():  # the plan's run done, its twin failed
            return dataclasses.replace(result, comparisons=(_compare(plan, opts, report, params, plan.model.dtype),))
        if result.rc != 0 or not opts.check:
            return result
        return _check(plan, plan_path, opts, record, workdir, (report, params), digest, twin is not None)


def run_script(plan: Plan, plan_path: str, script: str, args: list[str], *, timeout_s: float,
               env: dict[str, str] | None = None) -> RunResult:
    """`python SCRIPT ARGS` on every rank of the plan's cluster (`hetsynth launch`), launched
    as `run` launches its workers (module docstring), the plan file at `plan_path` (whose bytes
    must be `plan`) handed to the ranks in HETSYNTH_PLAN, and `env`; a cluster whose ranks run
    elsewhere gets its per-node commands instead. `timeout_s`: a rank without a heartbeat for
    that long (plus WATCHDOG_S) is stopped and named."""
    check_timeout(timeout_s)
    worker = script_args(os.path.abspath(script), args)
    env = {PATH_ENV: os.path.abspath(plan_path)} | (env or {})
    if not runs_here(plan.cluster):
        return RunResult(0, node_commands=node_commands(plan.cluster, worker, env))
    with recorded_run() as (record, workdir):
        digest = validated_digest(plan, plan_path)
        return _launched(record, workdir, plan.cluster, worker, timeout_s, plan_path, digest, env)
