"""A plan's communication instructions as small nn.Modules of the per-rank program.

Each module holds what its collective needs for this rank (spans: group, members, lengths;
variant; offsets) and prints it in `repr`, so a generated program reads as
`all_gather_linear_3 = self.all_gather_linear_3(linear_3)` with the module listing
`AllGather(axis=inner, dim=2, lengths=[16, 16], variant=ring)`. One builder per layout-change
kind, registered in CONVERSIONS (instruction_set.kinds).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from hetsynth.instruction_set.kinds import Implementations
from hetsynth.instruction_set.layouts import Layout
from hetsynth.instruction_set.plan import Plan
from hetsynth.instruction_set.program import Instruction
from hetsynth.instruction_set.shards import MeshLayout
from hetsynth.runtime import collectives as C
from hetsynth.runtime.groups import Groups
from hetsynth.runtime.mixed_precision import wire_dtype


class Conversion(nn.Module):
    """One instruction's collective. `wire`: the dtype it carries (runtime.mixed_precision's
    wire_dtype); a floating input in another dtype (under autocast, a 16-bit activation, or a
    float32 one of an op autocast keeps in float32) is cast to it first, so every rank of the
    collective sends and receives one dtype."""

    def __init__(self, name: str, fn: Callable[[torch.Tensor], torch.Tensor], description: str) -> None:
        super().__init__()
        self.name, self.fn, self.description = name, fn, description
        self.wire: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wire is not None and x.dtype != self.wire and x.is_floating_point():
            x = x.to(self.wire)
        return self.fn(x)

    def extra_repr(self) -> str:
        return self.description

    def _get_name(self) -> str:
        return self.name


def span(plan: Plan, groups: Groups, tensor: str, layout: Layout, axis: str) -> C.Span:
    """The span of `tensor` split by `layout` along `axis`: my group, its members' lengths."""
    members = tuple(groups.members(axis))
    placement = layout.axis(axis)
    dim = placement.dim if placement.is_shard else 0
    lengths = plan.lengths(tensor, layout)[dim] if placement.is_shard else (0,) * plan.cluster.num_devices
    return C.Span(groups.group(axis), members, groups.index(axis), dim,
                  tuple(lengths[groups.mesh.index(m)] for m in members))


Builder = Callable[[Plan, Groups, Instruction], Conversion]
CONVERSIONS: Implementations[Builder] = Implementations("conversion")


def make_conversion(plan: Plan, groups: Groups, ins: Instruction) -> Conversion:
    """The module running one forward layout-change instruction on this rank."""
    conversion = CONVERSIONS.get(ins.kind, phase=ins.phase)(plan, groups, ins)
    conversion.wire = wire_dtype(plan, ins.tensor)
    return conversion


def _head(ins: Instruction) -> str:
    return f"axis={ins.axis}, {ins.src}->{ins.layout}"


@CONVERSIONS.implements("all_gather")
def _all_gather(plan: Plan, groups: Groups, ins: Instruction) -> Conversion:
    s = span(plan, groups, ins.tensor, ins.src, ins.axis)
    return Conversion("AllGather", lambda x: C.all_gather(x, s, ins.variant),
                      f"{_head(ins)}, {s.describe()}, variant={ins.variant}")


@CONVERSIONS.implements("reduce_scatter")
def _reduce_scatter(plan: Plan, groups: Groups, ins: Instruction) -> Conversion:
    s = span(plan, groups, ins.tensor, ins.layout, ins.axis)
    return Conversion("ReduceScatter", lambda x: C.reduce_scatter(x, s, ins.variant),
                      f"{_head(ins)}, {s.describe()}, variant={ins.variant}")


@CONVERSIONS.implements("all_to_all")
def _all_to_all(plan: Plan, groups: Groups, ins: Instruction) -> Conversion:
    a, b = span(plan, groups, ins.tensor, ins.src, ins.axis), span(plan, groups, ins.tensor, ins.layout, ins.axis)
    return Conversion("AllToAll", lambda x: C.all_to_all(x, a, b),
                      f"{_head(ins)}, from {a.describe()} to {b.describe()}")


@CONVERSIONS.implements("all_reduce")
def _all_reduce(plan: Plan, groups: Groups, ins: Instruction) -> Conversion:
    s = groups.span(ins.axis)
    levels = (groups.span("inner"), groups.span("outer")) if ins.variant == "hierarchical" else None
    return Conversion("AllReduce", lambda x: C.all_reduce(x, s, levels), f"{_head(ins)}, variant={ins.variant}")


@CONVERSIONS.implements("all_reduce_max")
def _all_reduce_max(plan: Plan, groups: Groups, ins: Instruction) -> Conversion:
    s = groups.span(ins.axis)
    return Conversion("AllReduceMax", lambda x: C.all_reduce_max(x, s), _head(ins))


@CONVERSIONS.implements("partial")
def _partial(plan: Plan, groups: Groups, ins: Instruction) -> Conversion:
    keep = groups.index(ins.axis) == 0
    return Conversion("Partial", lambda x: C.partial(x, keep), f"{_head(ins)}, keep={keep}")


@CONVERSIONS.implements("slice")
def _slice(plan: Plan, groups: Groups, ins: Instruction) -> Conversion:
    """R -> S(d) along one axis: my rows of the local tensor. Inside a node, slicing a dim the
    node already holds a block of (one-level S(d) from S(d)|R), rows count from the block."""
    dim = ins.layout.axis(ins.axis).dim
    lengths = plan.lengths(ins.tensor, ins.layout)[dim]
    mesh, rank = groups.mesh, groups.rank
    offset = MeshLayout(mesh, ins.layout).offset(lengths, dim, rank)
    if ins.axis == "inner" and ins.layout.outer.dim == dim:
        offset -= sum(lengths[:mesh.node(rank) * mesh.per_node])
    length = lengths[mesh.index(rank)]
    return Conversion("Slice", lambda x: C.slice_rows(x, dim, offset, length),
                      f"axis={ins.axis}, {ins.src}->{ins.layout}, dim={dim}, rows=[{offset}, {offset + length})")
