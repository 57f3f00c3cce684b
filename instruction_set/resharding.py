"""Cross-mesh resharding as data: what moves where when one tensor goes from a source sub-mesh
and layout to a destination sub-mesh and layout (Zhuang et al., "On Optimizing the
Communication of Model Parallelism", MLSys'23).

The core works on TILES, not on layouts: each side is a list of member ranks, each with its
host and the box of the global tensor it holds (`Box`: an interval [start, stop) per dim; an
empty box holds nothing). instruction_set.reshard_sides is the one place that turns a layout,
its shard lengths and a (sub-)mesh into such a side.

  tiles    the distinct boxes of one side, each with its holders (replicas), in member order
  slices   source tile ∩ destination tile, for every pair with a non-empty intersection; the
           slices of a destination tile partition it (`check_slices`). Senders of a slice are
           its source tile's holders, receivers its destination tile's holders.
  chains   how a method moves the slices (planner.resharding): a `Chain` is a pipelined
           broadcast of `box` along `members` (members[0] holds it and sends it in chunks, each
           later member receives every chunk and forwards it to the next); a point-to-point
           send/recv is a chain of 2 members, a local copy a chain of 1. Phase 0 chains start
           at a source holder, phase 1 chains (local all-gather) at a destination replica that
           received the box in phase 0. `order` groups chains into rounds that run concurrently;
           a rank runs its rounds in (phase, order) order.

A Partial source (every source rank holds a summand of the whole tensor) is first reduced on
the source: a ring reduce-scatter to S(dim) with the lengths of `SourceReduction` (recorded in
the plan); tiles are taken from that reduced side.
"""

from __future__ import annotations

import itertools
import math
from enum import StrEnum

from pydantic import BaseModel, ConfigDict


class ReshardError(ValueError):
    """A resharding that cannot be done; the message names the tensor, layouts and meshes."""


class ReshardMethod(StrEnum):
    SEND_RECV = "send_recv"              # one transfer per (slice, receiver), least-loaded device
    LOCAL_ALLGATHER = "local_allgather"  # 1/k of a slice to each of k replicas on a host, then all-gather
    BROADCAST = "broadcast"              # one pipelined chain per slice, first holder sends
    BROADCAST_LB = "broadcast_lb"        # chains of pieces, sender hosts balanced, rounds sharing no NIC


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Box(_Frozen):
    """A hyper-rectangle of the global tensor: [start[d], stop[d]) in every dim d."""

    start: tuple[int, ...]
    stop: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def intersect(self, other: "Box") -> "Box | None":
        """The common part, or None when it is empty in some dim."""
        start = tuple(max(a, b) for a, b in zip(self.start, other.start))
        stop = tuple(min(a, b) for a, b in zip(self.stop, other.stop))
        return Box(start=start, stop=stop) if all(a < b for a, b in zip(start, stop)) else None

    def within(self, outer: "Box") -> tuple[slice, ...]:
        """Index of this box inside a tensor that holds `outer` (which contains it)."""
        assert all(o <= a and b <= p for a, b, o, p in zip(self.start, self.stop, outer.start, outer.stop)), \
            (self, outer)
        return tuple(slice(a - o, b - o) for a, b, o in zip(self.start, self.stop, outer.start))

    def split(self, parts: int) -> tuple["Box", ...]:
        """`parts` near-equal pieces along the box's longest dim (fewer when it is shorter;
        the pieces partition the box)."""
        if not self.shape:  # a 0-d box is one piece
            return (self,)
        dim = max(range(len(self.shape)), key=lambda d: (self.shape[d], -d))
        n = self.shape[dim] if self.shape else 0
        parts = max(1, min(parts, n))
        edges = [self.start[dim] + n * i // parts for i in range(parts + 1)]
        return tuple(Box(start=self.start[:dim] + (a,) + self.start[dim + 1:],
                         stop=self.stop[:dim] + (b,) + self.stop[dim + 1:])
                     for a, b in zip(edges, edges[1:]) if b > a) if self.shape else (self,)


def full_box(shape: tuple[int, ...]) -> Box:
    return Box(start=tuple(0 for _ in shape), stop=tuple(shape))


class TensorSide(_Frozen):
    """One side of a resharding: member ranks (mesh order), each member's host and box, whether
    the members hold Partial summands (each box is then the whole tensor), and a description
    ("layout S0|R on ranks 4-7 (hosts 2, 3)") for messages."""

    ranks: tuple[int, ...]
    hosts: tuple[int, ...]
    boxes: tuple[Box, ...]
    partial: bool = False
    describe: str = ""

    def box_of(self, rank: int) -> Box:
        return self.boxes[self.ranks.index(rank)]

    def host_of(self, rank: int) -> int:
        return self.hosts[self.ranks.index(rank)]


class ReshardSpec(_Frozen):
    tensor: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    src: TensorSide
    dst: TensorSide

    def host_of(self, rank: int) -> int:
        side = self.src if rank in self.src.ranks else self.dst
        return side.host_of(rank)


class Tile(_Frozen):
    box: Box
    holders: tuple[int, ...]


class Slice(_Frozen):
    """src_tiles[src_tile].box ∩ dst_tiles[dst_tile].box."""

    box: Box
    src_tile: int
    dst_tile: int
    nbytes: int


class SourceReduction(_Frozen):
    """The source is Partial: reduce-scatter it over the source ranks (ring over point-to-point)
    to S(dim) with these per-member lengths before anything moves."""

    dim: int
    lengths: tuple[int, ...]
    variant: str = "ring"


class Chain(_Frozen):
    slice: int
    box: Box
    members: tuple[int, ...]
    phase: int = 0
    order: int = 0
    chunk_elems: int = 1

    @property
    def key(self) -> tuple[int, int]:
        return self.phase, self.order


class MethodCost(_Frozen):
    """What the cost model predicts for one method, beside the NIC lower bound."""

    predicted_s: float
    lower_bound_s: float
    num_rounds: int


class ReshardPlan(_Frozen):
    spec: ReshardSpec
    source_reduction: SourceReduction | None
    src_tiles: tuple[Tile, ...]
    dst_tiles: tuple[Tile, ...]
    slices: tuple[Slice, ...]
    method: ReshardMethod
    chains: tuple[Chain, ...]
    predicted_s: float
    lower_bound_s: float
    alternatives: dict[ReshardMethod, MethodCost]

    def rank_chains(self, rank: int) -> tuple[tuple[int, Chain], ...]:
        """(index, chain) of the chains `rank` is a member of, by (phase, order, index)."""
        mine = [(i, c) for i, c in enumerate(self.chains) if rank in c.members]
        return tuple(sorted(mine, key=lambda ic: (ic[1].key, ic[0])))

    def summary(self) -> str:
        others = ", ".join(f"{m} {c.predicted_s:.3g}" for m, c in self.alternatives.items() if m != self.method)
        reduce = "source Partial reduced first; " if self.source_reduction else ""
        return (f"{self.spec.tensor}: {self.spec.src.describe} -> {self.spec.dst.describe}  {reduce}"
                f"{self.method} {self.predicted_s:.3g} s ({others}; NIC bound {self.lower_bound_s:.3g})")


def tiles(side: TensorSide) -> tuple[Tile, ...]:
    """The distinct non-empty boxes of a side with their holders, in first-seen (member) order."""
    holders: dict[Box, list[int]] = {}
    for rank, box in zip(side.ranks, side.boxes):
        if box.numel > 0:
            holders.setdefault(box, []).append(rank)
    return tuple(Tile(box=b, holders=tuple(h)) for b, h in holders.items())


def slices(src: tuple[Tile, ...], dst: tuple[Tile, ...], itemsize: int) -> tuple[Slice, ...]:
    """Every non-empty source tile ∩ destination tile, destination-tile major."""
    out = []
    for (j, d), (i, s) in itertools.product(enumerate(dst), enumerate(src)):
        box = s.box.intersect(d.box)
        if box is not None:
            out.append(Slice(box=box, src_tile=i, dst_tile=j, nbytes=box.numel * itemsize))
    return tuple(out)


def check_slices(src: tuple[Tile, ...], dst: tuple[Tile, ...], cut: tuple[Slice, ...]) -> None:
    """Invariant: the slices of every destination tile partition it (their sizes add up to it,
    and they are disjoint because the source tiles are)."""
    for j, tile in enumerate(dst):
        got = sum(s.box.numel for s in cut if s.dst_tile == j)
        assert got == tile.box.numel, f"destination tile {j} {tile.box} covered by {got} of {tile.box.numel} elements"


def check_chains(plan: ReshardPlan) -> None:
    """Invariant: every destination rank receives every element of its box exactly once, and
    every chain starts at a rank that holds its box by then."""
    got: dict[int, int] = {r: 0 for r in plan.spec.dst.ranks}
    for chain in plan.chains:
        tile = plan.dst_tiles[plan.slices[chain.slice].dst_tile]
        assert all(r in tile.holders for r in chain.members[1:]), chain
        first = chain.members[0]
        src_holders = plan.src_tiles[plan.slices[chain.slice].src_tile].holders
        assert first in (src_holders if chain.phase == 0 else tile.holders), chain
        for r in chain.members[1:] if len(chain.members) > 1 else chain.members:
            got[r] += chain.box.numel
    for r, box in zip(plan.spec.dst.ranks, plan.spec.dst.boxes):
        assert got[r] == box.numel, f"rank {r} receives {got[r]} of {box.numel} elements"


def reduced_side(side: TensorSide, dim: int, lengths: tuple[int, ...], shape: tuple[int, ...]) -> TensorSide:
    """A Partial side after its reduce-scatter to S(dim): member i holds rows
    [sum(lengths[:i]), sum(lengths[:i+1])) of `dim`."""
    assert side.partial and len(lengths) == len(side.ranks) and sum(lengths) == shape[dim], (lengths, shape)
    full, boxes, at = full_box(shape), [], 0
    for n in lengths:
        boxes.append(Box(start=full.start[:dim] + (at,) + full.start[dim + 1:],
                         stop=full.stop[:dim] + (at + n,) + full.stop[dim + 1:]))
        at += n
    return side.model_copy(update={"boxes": tuple(boxes), "partial": False,
                                   "describe": f"{side.describe}, reduce-scattered to S{dim}"})
