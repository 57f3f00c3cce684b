"""One rank of `hetsynth run`, started by torchrun (`python -m hetsynth.runtime.worker ...`).

Reads RANK / WORLD_SIZE / LOCAL_RANK from torchrun, initialises the default process group
(NCCL with a GPU per rank, gloo on CPUs) with a collective timeout, builds its program from
the plan, trains, and on rank 0 logs a line per step (`--quiet`: none) and writes a JSON report.
Any failure logs `rank N failed: ...` on stderr and exits 1, so torchrun stops the others.

With `--twin DTYPE` (run --check of a plan not in float64), the same ranks then train the
plan's twin in DTYPE in the same process group, quietly, writing `--twin-report` and
`--twin-params`: the check's second run without a second launch.

With `--trace-raw DIR`, the last `--trace-steps` steps (never the first one run) are traced
(runtime.timing: every instruction timed) and every rank writes DIR/rank<N>.json.

For tests of the failure paths, `HETSYNTH_FAULT=<rank>:<step>:<kind>` makes that rank, at
the start of that step, SIGKILL itself (`kill`), SIGSTOP itself (`stop`: a stuck rank) or
raise an error (`raise`); `overflow` (SPMD plans) instead sets one of its gradients to inf
once they are synchronised in that step, as a float16 overflow would (runtime.mixed_precision:
the loss scaler then skips the step on every rank).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hetsynth.runtime.quick_exit import freeze_at_exit
from hetsynth.instruction_set.files import write_atomic
from hetsynth.instruction_set.plan import Plan, PlanShape
from hetsynth.runtime.checkpoint import load_checkpoint, save_atomic, save_checkpoint
from hetsynth.runtime.config import add_train_arguments, train_config
from hetsynth.runtime.groups import Groups
from hetsynth.runtime.memory_report import RankMemory, as_json, format_report, measure_step
from hetsynth.runtime.outputs import check_outputs
from hetsynth.runtime.pipeline.run import run_pipeline
from hetsynth.runtime.plan_handoff import load_rank_plan
from hetsynth.runtime.rank import run_rank
from hetsynth.runtime.timing import StepTracer
from hetsynth.runtime.rank_state import assemble
from hetsynth.runtime.train import StepLog, Trainer, local_parameters, model_buffers, setup, train_step

log = logging.getLogger("hetsynth.runtime.worker")  # not __name__: this module runs as __main__ under torchrun


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hetsynth.runtime.worker")
    p.add_argument("--plan", required=True)
    add_train_arguments(p)
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    p.add_argument("--report", help="rank 0 writes a JSON report here")
    p.add_argument("--params-out", help="rank 0 writes the final whole parameters and buffers here (torch.save)")
    p.add_argument("--save", help="checkpoint at the end (labelled with the steps it holds)")
    p.add_argument("--resume", help="checkpoint to start from")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--trace-raw", help="directory: every rank writes rank<N>.json, the times of every "
                                       "instruction of the traced steps (runtime.timing)")
    p.add_argument("--trace-steps", type=int, default=1, help="the last N steps are traced")
    p.add_argument("--memory-report", action="store_true",
                   help="measure the memory of the second step run on every rank (runtime.memory_report)")
    p.add_argument("--twin", help="then, in the same process group, train the plan's twin in this dtype (the "
                                  "float64 twin of run --check): quiet, no checkpoint, no trace")
    p.add_argument("--twin-report", help="the twin's --report")
    p.add_argument("--twin-params", help="the twin's --params-out")
    return p.parse_args(argv)


def twin_args(args: argparse.Namespace) -> argparse.Namespace:
    """The twin's arguments: the run's, in `--twin`'s dtype, writing the twin's report and
    parameters, and nothing else (no checkpoint, step lines, memory report or trace)."""
    return argparse.Namespace(**(vars(args) | {
        "dtype": args.twin, "report": args.twin_report, "params_out": args.twin_params, "save": None,
        "quiet": True, "memory_report": False, "trace_raw": None, "twin": None}))


class InjectedFault(RuntimeError):
    """The failure HETSYNTH_FAULT asked for."""


def _inject(rank: int, step: int, trainer: Trainer | None = None) -> None:
    """The fault HETSYNTH_FAULT asks of this rank at this step, if any (module docstring)."""
    spec = os.environ.get("HETSYNTH_FAULT")
    if not spec:
        return
    at_rank, at_step, kind = spec.split(":")
    if (int(at_rank), int(at_step)) != (rank, step):
        if kind == "overflow" and trainer is not None:
            trainer.on_gradients = None
        return
    if kind == "overflow" and trainer is not None:
        trainer.on_gradients = lambda: _overflow(trainer)
        return
    if kind == "raise":
        raise InjectedFault(f"injected fault at step {step}")
    os.kill(os.getpid(), {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[kind])


def _overflow(trainer: Trainer) -> None:
    grad = next(p.grad for p in trainer.optimizer.param_groups[0]["params"] if p.grad is not None)
    grad.view(-1)[0] = float("inf")


def _step(trainer: Trainer, args: argparse.Namespace, step: int, start: int, tracer: StepTracer | None,
          memory: list[RankMemory]) -> StepLog:
    traced = tracer is not None and step >= max(args.steps - args.trace_steps, start + 1)
    run = (lambda: tracer.step(step)) if traced else (lambda: train_step(trainer, step))
    if not (args.memory_report and step == start + 1):
        return run()
    entries: list[StepLog] = []
    memory.append(measure_step(trainer, lambda: entries.append(run())))
    return entries[0]


def _train(trainer: Trainer, args: argparse.Namespace, start: int, tracer: StepTracer | None,
           memory: list[RankMemory]) -> list[dict]:
    rank = trainer.groups.rank
    steps = []
    for step in range(start, args.steps):
        _inject(rank, step, trainer)
        entry = _step(trainer, args, step, start, tracer, memory)
        steps.append({"step": step, "loss": entry.loss, "seconds": entry.seconds})
        scaler = trainer.module.scaler
        scale = f"  loss scale {scaler.get_scale():g}" if scaler.is_enabled() else ""
        if scaler.is_enabled():
            steps[-1]["loss_scale"] = float(scaler.get_scale())
        if rank == 0 and not args.quiet:
            log.info("step %4d/%d  loss %.6f  %8.1f ms%s", step + 1, args.steps, entry.loss, entry.seconds * 1e3, scale)
    return steps


def _memory_report(trainer: Trainer, args: argparse.Namespace, memory: list[RankMemory]) -> list[dict] | None:
    """Every rank's figures on rank 0 (printed there), or None without --memory-report."""
    if not args.memory_report:
        return None
    rows: list | None = [None] * dist.get_world_size() if trainer.groups.rank == 0 else None
    dist.gather_object(memory[0], rows, dst=0, group=trainer.groups.group("all"))
    if rows is None:
        return None
    log.info("%s", format_report(trainer.plan, rows, trainer.config.optimizer))
    return as_json(rows)


def _finish(trainer: Trainer, args: argparse.Namespace, steps: list[dict], start: int,
            memory: list[dict] | None) -> None:
    if args.save:
        step = start + len(steps)  # the steps the checkpoint holds
        save_checkpoint(trainer, args.save, step)
        if trainer.groups.rank == 0 and not args.quiet:
            log.info("saved %s (step %d)", args.save, step)
    if args.params_out:
        gathered = [None] * dist.get_world_size() if trainer.groups.rank == 0 else None
        dist.gather_object(local_parameters(trainer), gathered, dst=0, group=trainer.groups.group("all"))
        if trainer.groups.rank == 0:
            save_atomic(assemble(trainer.plan, gathered) | model_buffers(trainer), args.params_out)
    if trainer.groups.rank == 0 and args.report:
        times = [e["seconds"] for e in steps[1:]] or [e["seconds"] for e in steps]
        write_atomic(args.report, json.dumps({"first_step": start, "losses": [e["loss"] for e in steps],
                                              "step_seconds": [e["seconds"] for e in steps],
                                              "loss_scales": [e.get("loss_scale") for e in steps],
                                              "median_step_s": statistics.median(times) if times else None,
                                              "world_size": dist.get_world_size()}
                                             | ({"memory": memory} if memory else {})))


def main(argv: list[str] | None = None) -> int:
    freeze_at_exit()
    args = parse_args(argv)

    def body(rank: int, device: torch.device) -> None:
        if rank == 0:  # before any work: a bad path must not cost the run
            check_outputs({"--save": args.save, "--report": args.report, "--params-out": args.params_out,
                           "--twin-report": args.twin_report, "--twin-params": args.twin_params},
                          inputs={"--plan": args.plan, "--resume": args.resume})
        plan = load_rank_plan(args.plan)
        train_plan(plan, rank, device, args)
        if args.twin:
            if rank == 0:
                log.info("check: training the plan's %s twin (same program, %s tensors)", args.twin, args.twin)
            train_plan(plan, rank, device, twin_args(args))

    return run_rank(body, timeout_s=args.timeout)


def train_plan(plan: Plan, rank: int, device: torch.device, args: argparse.Namespace) -> None:
    """This rank's part of training `plan` as `args` say (an SPMD or a pipeline plan)."""
    if plan.shape is PlanShape.PIPELINE:
        run_pipeline(plan, rank, args, _inject)
        return
    groups = Groups.create(plan.mesh, rank, world=dist.group.WORLD)
    config = train_config(args)
    trainer = setup(plan, groups, config, device)
    start = load_checkpoint(trainer, args.resume, args.steps) if args.resume else 0
    if rank == 0 and args.resume and not args.quiet:
        log.info("resumed from %s (step %d): training steps %d-%d", args.resume, start, start + 1, args.steps)
    if args.memory_report and args.steps - start < 2:
        raise ValueError(f"--memory-report measures the second step run, but this run trains steps "
                         f"{start + 1}-{args.steps}; give --steps {start + 2} or more")
    tracer = StepTracer(trainer) if args.trace_raw else None
    memory: list[RankMemory] = []
    steps = _train(trainer, args, start, tracer, memory)
    _finish(trainer, args, steps, start, _memory_report(trainer, args, memory))
    if tracer is not None:
        write_atomic(Path(args.trace_raw, f"rank{rank}.json"), json.dumps(tracer.record()))


if __name__ == "__main__":
    sys.exit(main())
