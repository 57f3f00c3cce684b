"""`hetsynth run`: launch a plan with torchrun, on this machine or as per-node commands.

- A single-node cluster runs here: `torchrun --standalone` with one process per device (gloo
  on CPU, NCCL on GPUs).
- A cluster with an `emulation` section runs here on the emulated cluster
  (runtime.emulation): one torchrun per node, each inside its node's network namespace, with
  static rendezvous at node 0's address; each worker joins its device's cgroup. Without
  root, plain local processes run instead (correctness only) and a note says so.
- Any other multi-node cluster: the torchrun command for each node is printed.

Every torchrun runs in its own process session, and its output is streamed. torchrun stops a
node's other ranks as soon as one fails; when a node's torchrun fails, the other nodes'
sessions are killed; collectives also time out after `timeout_s`. The failure is reported
naming the rank that failed first, and nothing is left running.

`check` also trains the plain single-device model with the same initialisation, data and
optimizer and compares the loss of every step and the final parameters.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cost_models.cluster import ClusterSpec
from hetsynth.models import parse_model_ref
from instruction_set.plan import Plan
from runtime import emulation
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


def runs_here(cluster: ClusterSpec) -> bool:
    return len(cluster.nodes) == 1 or cluster.emulation is not None


def worker_args(plan_path: str, opts: RunOptions, report: str, params_out: str | None) -> list[str]:
    args = ["-m", "runtime.worker", "--plan", plan_path, "--steps", str(opts.steps),
            "--optimizer", opts.optimizer, "--lr", str(opts.lr), "--max-grad-norm", str(opts.max_grad_norm),
            "--timeout", str(opts.timeout_s), "--report", report]
    args += ["--params-out", params_out] if params_out else []
    args += ["--save", opts.save] if opts.save else []
    args += ["--resume", opts.resume] if opts.resume else []
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


SELF_REPORTED = re.compile(r"^rank (\d+) failed: (.*)")
SUMMARY_RANK = re.compile(r"^\s*rank\s*: (\d+)")
SUMMARY_EXIT = re.compile(r"^\s*exitcode\s*: (.*)")


@dataclass
class Failure:
    rank: int
    why: str


def _stream(proc: subprocess.Popen) -> Failure | None:
    """Echo the ranks' output; find the first failure: torchrun's root cause, else the first
    rank that reported its own failure."""
    assert proc.stdout is not None
    root: Failure | None = None
    reported: Failure | None = None
    in_root = False
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if "Root Cause" in line:
            in_root = True
        elif in_root and (m := SUMMARY_RANK.match(line)):
            root = Failure(int(m.group(1)), "")
        elif in_root and root is not None and not root.why and (m := SUMMARY_EXIT.match(line)):
            root.why = f"exit code {m.group(1).strip()}"
        elif reported is None and (m := SELF_REPORTED.match(line)):
            reported = Failure(int(m.group(1)), m.group(2))
    return root or reported


BASE_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def launch(cluster: ClusterSpec, module_args: list[str]) -> tuple[int, Failure | None]:
    """Run `python -m <module_args>` on every device of a cluster that runs here; returns
    (exit status, the first failure). Emulated when the spec asks and root allows."""
    if cluster.emulation is not None and len(cluster.nodes) > 1:
        reason = emulation.unavailable()
        if reason is None:
            return _launch_emulated(cluster, module_args)
        print(f"note: not emulating {cluster.name!r} ({reason}); running unshaped local processes "
              f"(correct results, no link shaping or CPU quotas)", flush=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={cluster.num_devices}", "--monitor-interval=0.5", *module_args]
    proc = _start(cmd, os.environ | BASE_ENV)
    try:
        failure = _stream(proc)
        return proc.wait(), failure
    finally:
        _kill_session(proc)


def launch_checked(cluster: ClusterSpec, module_args: list[str], what: str) -> None:
    """launch(), raising `<what> failed: rank N (why)` when a rank fails."""
    rc, failure = launch(cluster, module_args)
    if rc != 0:
        who = f"rank {failure.rank} ({failure.why})" if failure else f"exit status {rc}"
        raise RuntimeError(f"{what} failed: {who}")


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


def _launch_emulated(cluster: ClusterSpec, module_args: list[str]) -> tuple[int, Failure | None]:
    nodes = len(cluster.nodes)
    with emulation.Emulation(cluster) as emu:
        env = os.environ | BASE_ENV | {"GLOO_SOCKET_IFNAME": emulation.IFACE, emulation.ENV: emu.rank_env()}
        procs = [_start(emu.in_node(i, [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
                                         f"--node-rank={i}", f"--nproc-per-node={len(node.devices)}",
                                         f"--master-addr={emu.address(0)}", "--master-port=29500",
                                         "--monitor-interval=0.5", *module_args]), env)
                 for i, node in enumerate(cluster.nodes)]
        try:
            return _wait_all(procs)
        finally:
            for proc in procs:
                _kill_session(proc)


def _wait_all(procs: list[subprocess.Popen]) -> tuple[int, Failure | None]:
    """Stream every node's output; on the first failing node, stop the others."""
    results: dict[int, Failure | None] = {}
    threads = [threading.Thread(target=lambda i=i, p=p: results.__setitem__(i, _stream(p)), daemon=True)
               for i, p in enumerate(procs)]
    for t in threads:
        t.start()
    rc = 0
    while any(p.poll() is None for p in procs):
        bad = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if bad:
            rc = bad[0]
            for p in procs:
                _kill_session(p)
            break
        time.sleep(0.2)
    rc = rc or next((p.returncode for p in procs if p.returncode), 0)
    for t in threads:
        t.join(timeout=5)
    failures = [f for f in results.values() if f is not None]
    return rc, failures[0] if failures else None


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def check_against_single_device(plan: Plan, opts: RunOptions, workdir: str) -> int:
    spec = parse_model_ref(plan.model.ref)
    config = TrainConfig(steps=opts.steps, optimizer=opts.optimizer, lr=opts.lr, max_grad_norm=opts.max_grad_norm)
    losses, params = reference_training(spec, plan.model.batch_size, config)
    report = json.loads(Path(opts.report or os.path.join(workdir, "report.json")).read_text())
    got = torch.load(os.path.join(workdir, "params.pt"), weights_only=False)
    loss_err = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(report["losses"], losses))
    param_err = max(float((got[k] - params[k]).abs().max()) if got[k].numel() else 0.0 for k in got)
    ok = loss_err <= opts.tolerance and param_err <= opts.tolerance
    print(f"check: largest relative loss difference {loss_err:.3e}, largest parameter difference "
          f"{param_err:.3e} (tolerance {opts.tolerance:g}): {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def run(plan: Plan, plan_path: str, opts: RunOptions) -> int:
    if not runs_here(plan.cluster):
        print("\n\n".join(node_commands(plan, plan_path, opts)))
        return 0
    with tempfile.TemporaryDirectory(prefix="hetsynth-run-") as workdir:
        os.chmod(workdir, 0o755)
        report = opts.report or os.path.join(workdir, "report.json")
        params_out = os.path.join(workdir, "params.pt") if opts.check else None
        rc, failure = launch(plan.cluster, worker_args(plan_path, opts, report, params_out))
        if rc != 0:
            who = f"rank {failure.rank} failed ({failure.why})" if failure else "a rank failed"
            print(f"hetsynth run: {who}; the other ranks were stopped (torchrun exit status {rc})",
                  file=sys.stderr)
            return rc
        return check_against_single_device(plan, opts, workdir) if opts.check else 0
