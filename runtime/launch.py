"""`hetsynth run`: launch a plan with torchrun, on this machine or as per-node commands.

On this machine (a single-node cluster, or one with an `emulation` section) it starts
`torchrun --standalone` with one process per device of the plan (gloo on CPU) in a new
process session, streams the ranks' output, and returns torchrun's exit status. torchrun stops
the other ranks as soon as one fails; collectives also time out after `timeout_s`. A failure
is reported naming the rank(s) that failed first; nothing is left running (the session is
killed on exit). For a multi-node cluster it prints the torchrun command for each node.

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
from dataclasses import dataclass
from pathlib import Path

import torch

from cost_models.cluster import ClusterSpec
from hetsynth.models import parse_model_ref
from instruction_set.plan import Plan
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
        if "Root Cause" in line:
            in_root = True
        elif in_root and (m := SUMMARY_RANK.match(line)):
            root = Failure(int(m.group(1)), "")
        elif in_root and root is not None and not root.why and (m := SUMMARY_EXIT.match(line)):
            root.why = f"exit code {m.group(1).strip()}"
        elif reported is None and (m := SELF_REPORTED.match(line)):
            reported = Failure(int(m.group(1)), m.group(2))
    return root or reported


def launch_local(plan: Plan, plan_path: str, opts: RunOptions, workdir: str, *,
                 env: dict[str, str] | None = None, wrapper: list[str] | None = None) -> tuple[int, Failure | None]:
    """Run torchrun here; returns (exit status, the first failure)."""
    report = opts.report or os.path.join(workdir, "report.json")
    params_out = os.path.join(workdir, "params.pt") if opts.check else None
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={plan.cluster.num_devices}", "--monitor-interval=0.5",
           *worker_args(plan_path, opts, report, params_out)]
    full_env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | (env or {})
    proc = subprocess.Popen((wrapper or []) + cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=full_env, start_new_session=True)
    try:
        failure = _stream(proc)
        rc = proc.wait()
    finally:
        _kill_session(proc)
    return rc, failure


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
        rc, failure = launch_local(plan, plan_path, opts, workdir)
        if rc != 0:
            who = f"rank {failure.rank} failed ({failure.why})" if failure else "a rank failed"
            print(f"hetsynth run: {who}; the other ranks were stopped (torchrun exit status {rc})",
                  file=sys.stderr)
            return rc
        return check_against_single_device(plan, opts, workdir) if opts.check else 0
