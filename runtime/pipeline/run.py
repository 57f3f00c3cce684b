"""A pipeline plan under `hetsynth run` (runtime.worker dispatches here on `plan.shape`): set-up,
the steps with rank 0's log line per step, the report and the final parameters for `--check`.
Checkpoints, traces and the memory report are not built for pipeline plans yet: asking for one
is an error before anything trains."""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from instruction_set.plan import Plan
from runtime.config import train_config
from runtime.pipeline.trainer import assemble, local_buffers, local_parameters, setup, train_step

log = logging.getLogger("runtime.worker")

UNSUPPORTED = {"save": "--save", "resume": "--resume", "trace_raw": "--trace-raw", "memory_report": "--memory-report"}


def check_pipeline_args(args: argparse.Namespace) -> None:
    asked = [flag for attr, flag in UNSUPPORTED.items() if getattr(args, attr, None)]
    if asked:
        raise ValueError(f"{', '.join(asked)}: not available for pipeline plans yet; run the plan's SPMD shape "
                         f"(the same plan file with \"shape\": \"spmd\") to use it")


def run_pipeline(plan: Plan, rank: int, args: argparse.Namespace, inject: Callable[[int, int], None]) -> None:
    check_pipeline_args(args)
    trainer = setup(plan, rank, train_config(args), world=dist.group.WORLD)
    steps = []
    for step in range(args.steps):
        inject(rank, step)
        start = time.perf_counter()
        loss = train_step(trainer, step)
        steps.append({"step": step, "loss": loss, "seconds": time.perf_counter() - start})
        if rank == 0 and not args.quiet:
            log.info("step %4d/%d  loss %.6f  %8.1f ms", step + 1, args.steps, loss, steps[-1]["seconds"] * 1e3)
    if args.params_out:
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object((local_parameters(trainer), local_buffers(trainer)), gathered, dst=0, group=dist.group.WORLD)
        if rank == 0:
            buffers = {k: v for _, b in gathered for k, v in b.items()}
            for stage in trainer.pipeline.stages:  # each buffer as the stage that holds it left it
                buffers |= gathered[stage.first_rank][1]
            torch.save(assemble(trainer.plan, [p for p, _ in gathered]) | buffers, args.params_out)
    if rank == 0 and args.report:
        times = [e["seconds"] for e in steps[1:]] or [e["seconds"] for e in steps]
        with open(args.report, "w") as f:
            json.dump({"first_step": 0, "losses": [e["loss"] for e in steps],
                       "step_seconds": [e["seconds"] for e in steps],
                       "median_step_s": statistics.median(times) if times else None,
                       "world_size": dist.get_world_size(), "shape": "pipeline"}, f)
