"""Gradient buckets: which replicated parameters' gradients are all-reduced together, in what
order, as plan data (`Plan.gradient_sync`).

A parameter's gradient is complete once the backward pass has gone back past the first
compute instruction that reads it (its first use); the backward runs the program in reverse,
so gradients become ready in reverse order of first use. Buckets follow that order (what torch
DDP reaches after its bucket rebuild, Li et al., VLDB 2020): parameters sorted by first use,
latest first (ties by name), each appended to the open bucket of its all-reduce's (axis,
variant); a bucket closes when the next parameter would take it past `bucket_cap_bytes` (a
parameter larger than the cap is a bucket of its own; no parameter is split), the first bucket
of each (axis, variant) past `first_bucket_cap_bytes` when given (torch DDP: 1 MiB first so
that communication starts early, then 25 MiB); when `last_bucket_cap_bytes` is given, the
lane's last bucket is first cut off as the longest tail of its parameters within that cap (at
least one): it is ready only when the backward ends, so its all-reduce is never hidden. Buckets are
numbered by when their last gradient is ready. Bucket b is launched, asynchronously, as soon as
its last gradient is ready and every bucket before it has been launched, so the launch order
is the index order on every rank; it is waited once before clipping and the optimizer step
(runtime.grad_sync).

`ready_after[b]` is the compute instruction (the graph node) whose backward completes bucket
b: the earliest first use among its parameters. `nbytes[b]` is the bucket's size on the rank
that holds the most (an `R|S(d)` parameter is all-reduced across nodes and its local shard
differs between local indices: each cross-node group reduces its own size).

A ZeRO-3 parameter's gradient is in no bucket (it is reduce-scattered at each use, in the
backward). A ZeRO-2 parameter's gradient (instruction_set.training_state) is reduce-scattered onto every
rank's state rows instead of all-reduced: its sync goes into buckets of kind `reduce_scatter`
(variant: the plan's `state_shards.scatter_variant`), kept apart from the all-reduce buckets
as another (axis, kind, variant) is, and assigned by the same rule.

The cap is a plan decision: the planner picks the one the cost model predicts fastest
(planner.buckets) and `hetsynth plan --bucket-mb` forces one.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

from pydantic import BaseModel, ConfigDict

from hetsynth.instruction_set.graph import ReferenceGraph
from hetsynth.instruction_set.layouts import Layout
from hetsynth.instruction_set.program import Instruction
from hetsynth.instruction_set.training_state import TrainingState

DEFAULT_BUCKET_CAP_BYTES = 2**20  # torch DDP's first bucket (kDefaultFirstBucketBytes)
# asynchronous collectives ("stages", runtime.grad_sync) one bucket's all-reduce issues, per variant
SYNC_MESSAGES = {"ring": 1, "hierarchical": 3}


class GradBucket(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int
    axis: str
    variant: str
    kind: str = "all_reduce"  # or reduce_scatter: the gradients of ZeRO-2 parameters onto their state rows
    params: tuple[str, ...]   # graph parameter names, in buffer order
    ready_after: str          # the compute node whose backward completes the bucket
    nbytes: int               # bytes on the rank that holds the most


class BucketShape(NamedTuple):
    """How a lane's gradients are cut into buckets (assign_buckets): every bucket at most
    `cap` bytes, the first at most `first` (torch DDP's 1 MiB, so communication starts early),
    the last, the one ready when the backward ends and so never hidden, at most `last`."""

    cap: int
    first: int | None = None
    last: int | None = None

    def label(self) -> str:
        """The shape's name in GradientSync.chosen_from, in MiB: "4", "all" (one bucket),
        "1+25" (a 1 MiB first bucket, then 25 MiB), "25+0.25" (a last bucket of 0.25 MiB)."""
        text = "all" if self.cap >= ONE_BUCKET else f"{self.cap / 2**20:g}"
        first = "" if self.first is None else f"{self.first / 2**20:g}+"
        last = "" if self.last is None else f"+{self.last / 2**20:g}"
        return f"{first}{text}{last}"


ONE_BUCKET = 2**62  # a cap that puts every gradient of a lane in one bucket


class GradientSync(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    bucket_cap_bytes: int
    first_bucket_cap_bytes: int | None = None  # the first bucket's cap, when smaller (DDP's shape)
    last_bucket_cap_bytes: int | None = None   # the last bucket's cap, when smaller
    buckets: tuple[GradBucket, ...] = ()
    chosen_from: dict[str, float] = {}  # candidate shape (BucketShape.label) -> predicted step seconds

    @property
    def shape(self) -> BucketShape:
        return BucketShape(self.bucket_cap_bytes, self.first_bucket_cap_bytes, self.last_bucket_cap_bytes)


def first_uses(graph: ReferenceGraph, program: Sequence[Instruction]) -> dict[str, tuple[int, str]]:
    """Parameter -> (index of the first compute instruction reading it, that node)."""
    out: dict[str, tuple[int, str]] = {}
    for i, ins in enumerate(program):
        if not ins.runs_op:
            continue
        for name in graph.node(ins.node).inputs:
            out.setdefault(name, (i, ins.node))
    return out


def local_nbytes(graph: ReferenceGraph, shards: Mapping, name: str, layout: Layout) -> int:
    """The largest local size of a parameter in its storage layout, in bytes."""
    meta = graph.node(name).out
    shape = list(meta.shape)
    if layout.is_shard:
        for dim, lengths in shards[name][layout].items():
            shape[int(dim)] = max(lengths)
    return math.prod(shape) * meta.nbytes // max(math.prod(meta.shape), 1)


def unbucketed(program: Sequence[Instruction]) -> set[str]:
    """Parameters whose gradient sync is no bucket's: ZeRO-3's, reduce-scattered at each use
    in the backward (runtime.zero3)."""
    return {i.tensor for i in program if i.kind == "param" and i.state == TrainingState.ZERO3}


def sync_messages(bucket: GradBucket, group_size: int) -> int:
    """Asynchronous collectives one bucket issues: an all-reduce's stages (SYNC_MESSAGES); a
    reduce-scatter one (padded) or one reduce per member (grouped)."""
    if bucket.kind == "reduce_scatter":
        return group_size if bucket.variant == "grouped" else 1
    return SYNC_MESSAGES[bucket.variant]


def _sync_key(ins: Instruction, zero2: set[str], scatter_variant: str) -> tuple[str, str, str]:
    """(axis, kind, variant) of a parameter's gradient sync."""
    if ins.tensor in zero2:
        return (ins.axis, "reduce_scatter", scatter_variant)
    return (ins.axis, "all_reduce", ins.variant)


def assign_buckets(graph: ReferenceGraph, program: Sequence[Instruction], shards: Mapping,
                   cap_bytes: int, first_cap_bytes: int | None = None,
                   last_cap_bytes: int | None = None, *,
                   scatter_variant: str = "padded") -> tuple[GradBucket, ...]:
    """The buckets of a program's backward gradient syncs (module docstring)."""
    for what, cap in (("gradient bucket cap", cap_bytes), ("first gradient bucket cap", first_cap_bytes),
                      ("last gradient bucket cap", last_cap_bytes)):
        if cap is not None and cap < 1:
            raise ValueError(f"{what} {cap} bytes: must be at least 1")
    zero2 = {i.tensor for i in program if i.kind == "param" and i.state == TrainingState.ZERO2}
    zero3 = unbucketed(program)
    uses = first_uses(graph, program)
    syncs = [i for i in program if i.kind == "all_reduce" and i.phase == "backward" and i.tensor not in zero3]
    for ins in syncs:  # read by no compute instruction: ready only at the end of the backward
        uses.setdefault(ins.tensor, (-1, ""))
    syncs.sort(key=lambda i: (-uses[i.tensor][0], i.tensor))
    keys = {ins.tensor: _sync_key(ins, zero2, scatter_variant) for ins in syncs}
    lanes: dict[tuple[str, str, str], list[tuple[int, Instruction, int]]] = {}  # (axis, kind, variant) -> members
    for pos, ins in enumerate(syncs):
        lanes.setdefault(keys[ins.tensor], []).append((pos, ins, local_nbytes(graph, shards, ins.tensor, ins.layout)))
    done = [g for lane in lanes.values() for g in _lane_buckets(lane, cap_bytes, first_cap_bytes, last_cap_bytes)]
    done.sort(key=lambda g: g[-1][0])  # by readiness: the position of the last member
    return tuple(GradBucket(index=b, axis=g[0][1].axis, kind=keys[g[0][1].tensor][1], variant=keys[g[0][1].tensor][2],
                            params=tuple(i.tensor for _, i, _ in g),
                            ready_after=min((uses[i.tensor] for _, i, _ in g))[1],
                            nbytes=sum(s for _, _, s in g)) for b, g in enumerate(done))


def _lane_buckets(lane: list, cap: int, first_cap: int | None, last_cap: int | None) -> list[list]:
    """One (axis, kind, variant)'s members (position, instruction, bytes) in readiness order, cut
    into buckets: the last bucket takes the longest tail within `last_cap` (at least one
    member); before it a bucket closes when the next member would take it past the cap
    (`first_cap` for the first bucket, when given)."""
    cut, tail_bytes = len(lane), 0
    while last_cap is not None and cut > 0 and (cut == len(lane) or tail_bytes + lane[cut - 1][2] <= last_cap):
        tail_bytes += lane[cut - 1][2]
        cut -= 1
    out: list[list] = []
    held = 0  # bytes of the open bucket, added in its order (what summing it again would give)
    for member in lane[:cut]:
        limit = min(cap, first_cap) if len(out) == 1 and first_cap is not None else cap
        if not out or held + member[2] > limit:
            out.append([])
            held = 0
        out[-1].append(member)
        held += member[2]
    return out + ([lane[cut:]] if cut < len(lane) else [])


def check_buckets(sync: GradientSync, program: Sequence[Instruction]) -> None:
    """Every backward all-reduce of the program in exactly one bucket (but ZeRO-3's), and nothing else."""
    zero3 = unbucketed(program)
    want = sorted(i.tensor for i in program if i.kind == "all_reduce" and i.phase == "backward" and i.tensor not in zero3)
    got = sorted(p for b in sync.buckets for p in b.params)
    if got != want:
        raise ValueError(f"gradient buckets hold {got} but the program all-reduces the gradients of {want}")
    if [b.index for b in sync.buckets] != list(range(len(sync.buckets))):
        raise ValueError(f"gradient bucket indices {[b.index for b in sync.buckets]}: must be 0, 1, ... in order")


def gradient_sync(graph: ReferenceGraph, program: Sequence[Instruction], shards: Mapping,
                  cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                  chosen_from: Mapping[str, float] | None = None, scatter_variant: str = "padded") -> GradientSync:
    return GradientSync(bucket_cap_bytes=cap_bytes,
                        buckets=assign_buckets(graph, program, shards, cap_bytes, scatter_variant=scatter_variant),
                        chosen_from=dict(chosen_from or {}))


__all__ = ["DEFAULT_BUCKET_CAP_BYTES", "SYNC_MESSAGES", "GradBucket", "GradientSync", "assign_buckets", "check_buckets", "first_uses",
           "gradient_sync", "local_nbytes", "sync_messages", "unbucketed"]
