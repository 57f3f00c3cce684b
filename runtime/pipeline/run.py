"""A pipeline plan under `hetsynth run` (runtime.worker dispatches here on `plan.shape`): set-up,
the steps with rank 0's log line per step, the report and the final parameters for `--check`.
Checkpoints (`--save`, `--resume`: runtime.pipeline.checkpoint, the SPMD plans' format, so either
shape resumes the other's) are built; traces and the memory report are not built for pipeline
plans yet: asking for one is an error before anything trains."""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from typing import Any, Callable

import torch.distributed as dist

from hetsynth.instruction_set.files import write_atomic
from hetsynth.instruction_set.plan import Plan
from hetsynth.runtime.checkpoint import save_atomic
from hetsynth.runtime.config import train_config
from hetsynth.runtime.pipeline.checkpoint import load_pipeline_checkpoint, save_pipeline_checkpoint, whole_buffers
from hetsynth.runtime.pipeline.trainer import assemble, local_buffers, local_parameters, setup, train_step

log = logging.getLogger("hetsynth.runtime.worker")

UNSUPPORTED = {"trace_raw": "--trace-raw", "memory_report": "--memory-report"}


def check_pipeline_args(args: argparse.Namespace | Any) -> None:
    """ValueError for the run options pipeline plans do not have yet (argparse's or the
    launcher's RunOptions: the same attribute names)."""
    asked = [flag for attr, flag in UNSUPPORTED.items() if getattr(args, attr, None)]
    if asked:
        raise ValueError(f"{', '.join(asked)}: not available for pipeline plans yet; run the plan's SPMD shape "
                         f"(the same plan file with \"shape\": \"spmd\") to use it")


def run_pipeline(plan: Plan, rank: int, args: argparse.Namespace, inject: Callable[[int, int], None]) -> None:
    check_pipeline_args(args)
    trainer = setup(plan, rank, train_config(args), world=dist.group.WORLD)
    start = load_pipeline_checkpoint(trainer, args.resume, args.steps) if args.resume else 0
    if rank == 0 and args.resume and not args.quiet:
        log.info("resumed from %s (step %d): training steps %d-%d", args.resume, start, start + 1, args.steps)
    steps = []
    for step in range(start, args.steps):
        inject(rank, step)
        began = time.perf_counter()
        loss = train_step(trainer, step)
        steps.append({"step": step, "loss": loss, "seconds": time.perf_counter() - began})
        if rank == 0 and not args.quiet:
            log.info("step %4d/%d  loss %.6f  %8.1f ms", step + 1, args.steps, loss, steps[-1]["seconds"] * 1e3)
    if args.save:
        save_pipeline_checkpoint(trainer, args.save, args.steps)
        if rank == 0 and not args.quiet:
            log.info("saved %s (step %d)", args.save, args.steps)
    if args.params_out:
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object((local_parameters(trainer), local_buffers(trainer)), gathered, dst=0, group=dist.group.WORLD)
        if rank == 0:
            buffers = whole_buffers(trainer, [b for _, b in gathered])
            save_atomic(assemble(trainer.plan, [p for p, _ in gathered]) | buffers, args.params_out)
    if rank == 0 and args.report:
        times = [e["seconds"] for e in steps[1:]] or [e["seconds"] for e in steps]
        write_atomic(args.report, json.dumps({"first_step": start, "losses": [e["loss"] for e in steps],
                                              "step_seconds": [e["seconds"] for e in steps],
                                              "median_step_s": statistics.median(times) if times else None,
                                              "world_size": dist.get_world_size(), "shape": "pipeline"}))
