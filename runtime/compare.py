"""Time several plans of one model on the same ranks, interleaved (`python -m hetsynth.runtime.compare`).

Every rank builds a trainer for each plan, warms each up, then runs `rounds` rounds in which
each plan trains `steps` steps in turn, so all plans see the same machine conditions. Each
round's batches are made before its steps are timed (as a prefetching data loader would), so
step times are training alone. Rank 0
records every step's wall time; the first rank of each node also reads its node's NIC
transmit counter (bytes on the inter-node wire, on an emulated cluster) around each plan's
steps. Rank 0 writes {plan name: {"step_seconds": [...], "median_s": ..., "losses": [global
loss of every step, warm-up included, in step order], "phases_by_rank": [each rank's median
seconds per phase: data, forward, backward, gradient_sync, update, loss, and when each gradient
bucket was launched and completed], "wire_bytes_per_step":
...}}; a pipeline plan's entry also has "events_by_rank": every timed step's actions on each
rank, [[op, micro-batch, start, end], ...] in seconds from the earliest rank's start of that
step (one clock: the ranks share a machine), to set against the predicted timeline.

`--traced NAME` also runs, in every round right after plan NAME's steps, as many steps of NAME
with every instruction timed (runtime.timing), on the same trainer: the report's "traced"
entry holds their step times next to the untraced ones of the same rounds (the cost of
tracing, interleaved), and every rank writes its raw record to `--trace-raw DIR`.

A pipeline plan (shape pipeline) is trained by runtime.pipeline's executor; its phases are
this rank's actions, gradient syncs and update (runtime.pipeline.trainer.train_step).

`--user NAME=PLAN` adds PLAN's module (runtime.parallel.ParallelModule, what
`hetsynth.parallelize` returns) trained by a user's loop: torch's AdamW on its parameters,
forward, backward, clip_grad_norm_, step, zero_grad, global_loss; its step time is that loop's
wall time, phases not split.

Besides plans, `--ddp NAME=MODE:PLAN` adds torch's DistributedDataParallel on the plain model
(runtime.ddp) with the per-rank rows that PLAN gives its batch input: MODE `mean` is DDP as users
run it (every rank backpropagates its own mean loss), `weighted` adds the loss weights that make
uneven rows train the global batch. Its entries are interleaved with the plans' like any other.

`--fsdp NAME=MODE:PLAN` adds torch's FSDP2 (runtime.fsdp) on PLAN's model and batch: MODE `even`
splits the batch evenly (as users run it), `proportional` in proportion to the throughput of
PLAN's devices with runtime.ddp's loss weights; a `-ckpt` suffix adds activation checkpointing
to every block. Every entry keeps its own model and optimizer state for the whole launch, so
where memory binds, time one memory-hungry entry per launch (bench/memory_bound.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from hetsynth.runtime.quick_exit import freeze_at_exit
from hetsynth.instruction_set.files import write_atomic
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.instruction_set.plan import Plan, PlanShape
from hetsynth.runtime.config import TrainConfig
from hetsynth.runtime.emulation import IFACE
from hetsynth.runtime.groups import Groups
from hetsynth.runtime.pipeline import trainer as pipeline_trainer
from hetsynth.runtime.plan_handoff import load_rank_plan
from hetsynth.runtime.rank import run_rank
from hetsynth.runtime.ddp import DDPTrainer, ddp_setup
from hetsynth.runtime.fsdp import even_rows, fsdp_setup, proportional_rows
from hetsynth.runtime.timing import StepTracer
from hetsynth.runtime.parallel import ParallelModule
from hetsynth.runtime.train import (StepLog, Trainer, batch_rows, full_state, local_batch, make_optimizer, rank_rows, setup,
                           train_step)

DDP_MODES = ("mean", "weighted")
FSDP_MODES = ("even", "even-ckpt", "proportional", "proportional-ckpt")


class PlanEntry:
    """A plan's trainer, seen as a comparison entry (make_batch, step)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def make_batch(self, step: int) -> list[torch.Tensor]:
        return local_batch(self.trainer, step)

    def step(self, step: int, inputs: list[torch.Tensor]) -> StepLog:
        return train_step(self.trainer, step, inputs)


class TracedEntry(PlanEntry):
    """A plan's trainer whose steps time every instruction (runtime.timing)."""

    def __init__(self, tracer: StepTracer) -> None:
        super().__init__(tracer.trainer)
        self.tracer = tracer

    def step(self, step: int, inputs: list[torch.Tensor]) -> StepLog:
        return self.tracer.step(step, inputs)


class UserLoopEntry:
    """A plan's module in a user's loop (module docstring)."""

    def __init__(self, plan: Plan, groups: Groups, config: TrainConfig) -> None:
        self.spec, self.config, self.batch = parse_model_ref(plan.model.ref), config, plan.model.batch_size
        state = full_state(self.spec, config.seed)
        self.module = ParallelModule(plan, groups, state, {k: k for k in state}, torch.device("cpu"))
        self.optimizer = make_optimizer(list(self.module.parameters()), config)

    def make_batch(self, step: int) -> list[torch.Tensor]:
        return batch_rows(self.spec, self.module.rows, step * self.batch, self.config.data_seed)

    def step(self, step: int, inputs: list[torch.Tensor]) -> StepLog:
        start = time.perf_counter()
        loss = self.module(*inputs)
        loss.backward()
        if self.config.max_grad_norm is not None:
            self.module.clip_grad_norm_(self.config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()
        total = self.module.global_loss(loss)
        return StepLog(total, time.perf_counter() - start)


class PipelineEntry:
    """A pipeline plan's trainer (runtime.pipeline): its micro-batches' data is made inside
    the step, by each stage for its own rows (a few random tokens: not prefetched)."""

    def __init__(self, trainer: "pipeline_trainer.PipelineTrainer") -> None:
        self.trainer = trainer

    def make_batch(self, step: int) -> list[torch.Tensor]:
        return []

    def step(self, step: int, inputs: list[torch.Tensor]) -> StepLog:
        start = time.perf_counter()
        loss = pipeline_trainer.train_step(self.trainer, step)
        return StepLog(loss, time.perf_counter() - start, dict(self.trainer.phases))

    def events(self) -> list[tuple[str, int, float, float]]:
        """The last step's actions (runtime.pipeline.trainer.train_step), absolute seconds."""
        return list(self.trainer.events)


Entry = PlanEntry | UserLoopEntry | PipelineEntry | DDPTrainer  # DDP and FSDP2 entries alike


def nic_tx_bytes() -> int | None:
    """Bytes sent by this network namespace's eth0 (None outside an emulated node)."""
    out = subprocess.run(["ip", "-j", "-s", "link", "show", IFACE], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return int(json.loads(out.stdout)[0]["stats64"]["tx"]["bytes"])


def _wire(reads_nic: bool, before: int | None) -> int:
    """Sum over nodes of the bytes their NIC sent since `before` (collective)."""
    mine = 0
    if reads_nic and before is not None:
        mine = (nic_tx_bytes() or 0) - before
    total = torch.tensor([mine], dtype=torch.float64)
    dist.all_reduce(total)
    return int(total.item())


def _steps(entry: Entry, first: int, count: int, phases: list | None = None,
           events: list | None = None) -> list[tuple[float, float]]:
    """(seconds, global loss) of `count` steps from step `first`; each step's phase seconds
    on this rank are appended to `phases`, and a pipeline entry's actions to `events`."""
    batches = [entry.make_batch(first + i) for i in range(count)]  # prefetched, not timed
    # start the timed steps together: a slow device makes its batches long after a fast one,
    # whose first step would otherwise time that wait (on the emulated cluster 1.5-2.3 s
    # against a 0.1 s step for 8192 tokens of a GPT MLP)
    dist.barrier()
    logs = []
    for i, inputs in enumerate(batches):
        logs.append(entry.step(first + i, inputs))
        if events is not None and isinstance(entry, PipelineEntry):
            events.append(entry.events())
    if phases is not None:
        phases += [log.phases | bucket_marks(log) for log in logs]
    return [(log.seconds, log.loss) for log in logs]


def bucket_marks(log: StepLog) -> dict[str, float]:
    """When each gradient bucket was launched and seen complete, in seconds from the start of
    the step's forward pass ("bucket<i>_launched", "bucket<i>_done")."""
    return {f"bucket{b.index}_{what}": getattr(b, f"{what}_s") for b in log.buckets for what in ("launched", "done")}


def _median_phases(steps: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in steps) for k in steps[0]} if steps else {}


def aligned_events(by_rank: list[list[list[tuple[str, int, float, float]]]]) -> list[list[list]]:
    """Per rank, per step, its actions in seconds from the earliest rank's start of that step
    (each step's first event is its ("step", -1, start, end))."""
    if not by_rank or not by_rank[0]:
        return [[] for _ in by_rank]
    zero = [min(rank[i][0][2] for rank in by_rank) for i in range(len(by_rank[0]))]
    return [[[[op, m, round(a - zero[i], 6), round(b - zero[i], 6)] for op, m, a, b in step]
             for i, step in enumerate(rank)] for rank in by_rank]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetsynth.runtime.compare",
                                description="Time several plans of one model on the same ranks, interleaved "
                                            "(run under torchrun, or hetsynth's launcher, on every rank)")
    p.add_argument("--plans", nargs="*", default=[], help="plan files of hetsynth's entries (one model)")
    p.add_argument("--names", nargs="*", default=[], help="one name per plan, as the report names them")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds before the timed ones")
    p.add_argument("--rounds", type=int, default=4, help="timed rounds; each runs every entry in turn")
    p.add_argument("--steps", type=int, default=2, help="steps per plan per round")
    p.add_argument("--report", required=True, help="JSON file rank 0 writes: every entry's step times")
    p.add_argument("--traced", help="the plan whose steps are also run traced, interleaved (module docstring)")
    p.add_argument("--trace-raw", help="directory for every rank's raw record of the traced steps")
    p.add_argument("--ddp", nargs="*", default=[], metavar="NAME=MODE:PLAN",
                   help="torch DDP entries: MODE mean|weighted, rows per rank from PLAN's batch input")
    p.add_argument("--fsdp", nargs="*", default=[], metavar="NAME=MODE:PLAN",
                   help=f"torch FSDP2 entries: MODE one of {', '.join(FSDP_MODES)} (module docstring)")
    p.add_argument("--user", nargs="*", default=[], metavar="NAME=PLAN",
                   help="PLAN's module (hetsynth.parallelize's) trained by a user's loop (module docstring)")
    return p


def main(argv: list[str] | None = None) -> int:
    freeze_at_exit()
    p = build_parser()
    args = p.parse_args(argv)
    if len(args.plans) != len(args.names):
        p.error(f"{len(args.plans)} --plans but {len(args.names)} --names: give one name per plan")
    if args.traced is not None and args.traced not in args.names:
        p.error(f"--traced {args.traced!r}: not one of the plans {args.names}")
    try:
        args.ddp = [parse_ddp(text) for text in args.ddp]
        args.user = [parse_user(text) for text in args.user]
        args.fsdp = [parse_fsdp(text) for text in args.fsdp]
    except ValueError as err:
        p.error(str(err))
    return run_rank(lambda rank, device: compare(rank, args), timeout_s=300, device=torch.device("cpu"))


def parse_moded(flag: str, text: str, modes: Sequence[str]) -> tuple[str, str, str]:
    """`NAME=MODE:PLAN` of a --ddp or --fsdp entry -> (name, mode, plan path)."""
    name, _, rest = text.partition("=")
    mode, _, path = rest.partition(":")
    if not name or mode not in modes or not path:
        raise ValueError(f"{flag} {text!r}: expected NAME=MODE:PLAN with MODE one of {', '.join(modes)}")
    return name, mode, path


def parse_ddp(text: str) -> tuple[str, str, str]:
    return parse_moded("--ddp", text, DDP_MODES)


def parse_fsdp(text: str) -> tuple[str, str, str]:
    return parse_moded("--fsdp", text, FSDP_MODES)


def fsdp_rows(plan: Plan, mode: str) -> list[int]:
    """The FSDP2 entry's rows per rank: even, or in proportion to the devices' throughput."""
    batch, world = plan.model.batch_size, plan.cluster.num_devices
    if mode.startswith("even"):
        return even_rows(batch, world)
    return proportional_rows(batch, [plan.cluster.device_kind(r).throughput_flops for r in range(world)])


def parse_user(text: str) -> tuple[str, str]:
    """`NAME=PLAN` -> (name, plan path)."""
    name, _, path = text.partition("=")
    if not name or not path:
        raise ValueError(f"--user {text!r}: expected NAME=PLAN")
    return name, path


def plan_rows(plan: Plan) -> list[int]:
    """Rows of the global batch each rank holds under `plan` (its first batch input)."""
    name, layout = next((i.tensor, i.layout) for i in plan.instructions if i.kind == "input")
    batch = plan.model.batch_size
    return [len(rank_rows(plan, name, layout, r, batch)) for r in range(plan.cluster.num_devices)]


def _entries(rank: int, args: argparse.Namespace) -> tuple[dict[str, Entry], bool]:
    """The entries in order (plans, user loops, DDP, then FSDP2) and whether this rank reads its node's NIC."""
    entries: dict[str, Entry] = {}
    reads_nic = False
    for name, path in zip(args.names, args.plans):
        plan = load_rank_plan(path)
        if plan.shape is PlanShape.PIPELINE:
            entries[name] = PipelineEntry(pipeline_trainer.setup(plan, rank, TrainConfig(steps=0), world=dist.group.WORLD))
            reads_nic = plan.mesh.local(rank) == 0
            continue
        groups = Groups.create(plan.mesh, rank, world=dist.group.WORLD)
        entries[name] = PlanEntry(setup(plan, groups, TrainConfig(steps=0)))
        reads_nic = groups.mesh.local(rank) == 0
    for name, path in args.user:
        plan = load_rank_plan(path)
        entries[name] = UserLoopEntry(plan, Groups.create(plan.mesh, rank, world=dist.group.WORLD), TrainConfig(steps=0))
    for name, mode, path in args.ddp:
        plan = load_rank_plan(path)
        entries[name] = ddp_setup(parse_model_ref(plan.model.ref), plan_rows(plan), TrainConfig(steps=0),
                                  group=dist.group.WORLD, rank=rank, weighted=mode == "weighted")
    for name, mode, path in args.fsdp:
        plan = load_rank_plan(path)
        entries[name] = fsdp_setup(parse_model_ref(plan.model.ref), fsdp_rows(plan, mode), TrainConfig(steps=0),
                                   group=dist.group.WORLD, rank=rank, weighted=mode.startswith("proportional"),
                                   checkpoint=mode.endswith("-ckpt"))
    return entries, reads_nic


def compare(rank: int, args: argparse.Namespace) -> None:
    """Train every entry on this rank, interleaved; rank 0 writes the report."""
    entries, reads_nic = _entries(rank, args)
    times: dict[str, list[float]] = {n: [] for n in entries}
    losses: dict[str, list[float]] = {n: [] for n in entries}
    phases: dict[str, list[dict]] = {n: [] for n in entries}
    events: dict[str, list] = {n: [] for n in entries}
    wire: dict[str, int] = {n: 0 for n in entries}
    step = {n: 0 for n in entries}
    tracer = StepTracer(entries[args.traced].trainer) if args.traced else None
    traced: list[float] = []
    for name, entry in entries.items():
        losses[name] += [loss for _, loss in _steps(entry, 0, args.warmup)]
        step[name] = args.warmup
    for _ in range(args.rounds):
        for name, entry in entries.items():
            before = nic_tx_bytes() if reads_nic else None
            logs = _steps(entry, step[name], args.steps, phases[name], events[name])
            times[name] += [seconds for seconds, _ in logs]
            losses[name] += [loss for _, loss in logs]
            wire[name] += _wire(reads_nic, before)
            step[name] += args.steps
            if name == args.traced:
                logs = _steps(TracedEntry(tracer), step[name], args.steps)
                traced += [seconds for seconds, _ in logs]
                losses[name] += [loss for _, loss in logs]
                step[name] += args.steps
    mine = {n: _median_phases(p) for n, p in phases.items()}
    every = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, every, dst=0)
    actions = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(events, actions, dst=0)
    if tracer is not None and args.trace_raw:
        write_atomic(Path(args.trace_raw, f"rank{rank}.json"), json.dumps(tracer.record()))
    if rank == 0:
        steps = args.rounds * args.steps
        report: dict = {n: {"step_seconds": t, "median_s": statistics.median(t), "losses": losses[n],
                            "phases_by_rank": [e[n] for e in every],
                            "wire_bytes_per_step": wire[n] / steps} for n, t in times.items()}
        for n in times:
            if isinstance(entries[n], PipelineEntry):
                report[n]["events_by_rank"] = aligned_events([a[n] for a in actions])
        if tracer is not None:
            report["traced"] = {"name": args.traced, "step_seconds": traced, "median_s": statistics.median(traced),
                                "untraced_step_seconds": times[args.traced]}
        write_atomic(args.report, json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
