"""A plan's communication instructions as small nn.Modules of the per-rank program.

Each module holds what its collective needs for this rank (spans: group, members, lengths;
variant; offsets) and prints it in `repr`, so a generated program reads as
`all_gather_linear_3 = self.all_gather_linear_3(linear_3)` with the module listing
`AllGather(axis=inner, dim=2, lengths=[16, 16], variant=ring)`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from instruction_set.layouts import axes, shard_dim
from instruction_set.plan import Plan
from instruction_set.program import Instruction
from instruction_set.shards import rank_offset
from runtime import collectives as C
from runtime.groups import Groups


class Conversion(nn.Module):
    def __init__(self, name: str, fn: Callable[[torch.Tensor], torch.Tensor], description: str) -> None:
        super().__init__()
        self.name, self.fn, self.description = name, fn, description

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)

    def extra_repr(self) -> str:
        return self.description

    def _get_name(self) -> str:
        return self.name


def _axis_component(layout: str, axis: str) -> str:
    outer, inner = axes(layout)
    return {"all": layout, "inner": inner, "outer": outer}[axis]


def span(plan: Plan, groups: Groups, tensor: str, layout: str, axis: str) -> C.Span:
    """The span of `tensor` split by `layout` along `axis`: my group, its members' lengths."""
    members = tuple(groups.members(axis))
    placement = _axis_component(layout, axis)
    dim = shard_dim(placement) if placement[0] == "S" else 0
    lengths = plan.lengths(tensor, layout)[dim] if placement[0] == "S" else (0,) * plan.cluster.num_devices
    return C.Span(groups.group(axis), members, groups.index(axis), dim,
                  tuple(lengths[m] for m in members))


def make_conversion(plan: Plan, groups: Groups, ins: Instruction) -> Conversion:
    kind, axis, t = ins.kind, ins.axis, ins.tensor
    head = f"axis={axis}, {ins.src}->{ins.layout}"
    if kind == "all_gather":
        s = span(plan, groups, t, ins.src, axis)
        return Conversion("AllGather", lambda x: C.all_gather(x, s, ins.variant),
                          f"{head}, {s.describe()}, variant={ins.variant}")
    if kind == "reduce_scatter":
        s = span(plan, groups, t, ins.layout, axis)
        return Conversion("ReduceScatter", lambda x: C.reduce_scatter(x, s, ins.variant),
                          f"{head}, {s.describe()}, variant={ins.variant}")
    if kind == "all_to_all":
        a, b = span(plan, groups, t, ins.src, axis), span(plan, groups, t, ins.layout, axis)
        return Conversion("AllToAll", lambda x: C.all_to_all(x, a, b),
                          f"{head}, from {a.describe()} to {b.describe()}")
    if kind == "all_reduce":
        s = groups.span(axis)
        levels = (groups.span("inner"), groups.span("outer")) if ins.variant == "hierarchical" else None
        return Conversion("AllReduce", lambda x: C.all_reduce(x, s, levels), f"{head}, variant={ins.variant}")
    if kind == "all_reduce_max":
        s = groups.span(axis)
        return Conversion("AllReduceMax", lambda x: C.all_reduce_max(x, s), head)
    if kind == "slice":
        return _slice(plan, groups, ins)
    if kind == "partial":
        keep = groups.index(axis) == 0
        return Conversion("Partial", lambda x: C.partial(x, keep), f"{head}, keep={keep}")
    raise ValueError(f"not a conversion: {ins.describe()}")


def _slice(plan: Plan, groups: Groups, ins: Instruction) -> Conversion:
    """R -> S(d) along one axis: my rows of the local tensor. Inside a node, slicing a dim the
    node already holds a block of (one-level S(d) from S(d)|R), rows count from the block."""
    dim = shard_dim(_axis_component(ins.layout, ins.axis))
    lengths = plan.lengths(ins.tensor, ins.layout)[dim]
    mesh, rank = groups.mesh, groups.rank
    offset = rank_offset(lengths, ins.layout, dim, mesh, rank)
    if ins.axis == "inner" and shard_dim(axes(ins.layout)[0]) == dim:
        offset -= sum(lengths[:mesh.node(rank) * mesh.per_node])
    length = lengths[rank]
    return Conversion("Slice", lambda x: C.slice_rows(x, dim, offset, length),
                      f"axis={ins.axis}, {ins.src}->{ins.layout}, dim={dim}, rows=[{offset}, {offset + length})")
