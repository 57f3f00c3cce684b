"""Consistency of a plan, checked when it is loaded (instruction_set.plan's validator).

A plan file may be edited or truncated by hand; the runtime trusts what it reads, so a plan
is refused on load unless

- its sharding ratios are finite, >= 0, one per device of its cluster, and sum to 1;
- its mesh (nodes x devices per node, from rank 0) covers the cluster, node by node when
  two-level, and is two-level exactly when it has more than one node;
- every shard-table entry names a tensor of its graph, a layout valid for the tensor, a dim
  that layout splits, one length >= 0 per rank, and lengths that add up to the dim:
    one-level split (or both axes on the dim)   sum over all ranks = size
    across nodes only (A of A|B)                one block per node, the same on all of its
                                                ranks, blocks summing to size
    inside nodes only (B of A|B)                the same split on every node, summing to size
  and that are the plan's ratios rounded as the planner rounds them (instruction_set.shards):
  `d * largest_remainder(ratios, size / d)` along the axis for some unit d dividing the size
  (d is the dim's share of its class's unit; a swapped or shifted length matches no d);
- every instruction names tensors of its graph, and every sharded layout an instruction
  reads or writes has its shard lengths in the table.

Each failure raises ValueError naming the tensor, layout or field and the numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from hetsynth.instruction_set.graph import ReferenceGraph
from hetsynth.instruction_set.layouts import Layout, LayoutField
from hetsynth.instruction_set.mesh import Mesh
from hetsynth.instruction_set.program import Instruction
from hetsynth.instruction_set.shards import Rounding

ShardTable = dict[str, dict[LayoutField, dict[int, tuple[int, ...]]]]  # tensor -> layout -> dim -> lengths

RATIO_TOLERANCE = 1e-6


@dataclass(frozen=True)
class PlanParts:
    """What the checks read of a plan (instruction_set.plan fills it in)."""

    ratios: tuple[float, ...]
    mesh: Mesh
    node_sizes: tuple[int, ...]  # devices per node of the plan's cluster
    graph: ReferenceGraph
    shards: ShardTable
    instructions: tuple[Instruction, ...]
    num_predicted: int  # devices in the prediction

    @property
    def num_devices(self) -> int:
        return sum(self.node_sizes)


def check_ratios(ratios: Sequence[float], num_devices: int) -> None:
    if len(ratios) != num_devices:
        raise ValueError(f"sharding_ratios has {len(ratios)} entries for {num_devices} devices")
    bad = [(i, r) for i, r in enumerate(ratios) if not (math.isfinite(r) and r >= 0)]
    if bad:
        raise ValueError(f"sharding_ratios[{bad[0][0]}] = {bad[0][1]}: ratios must be finite and >= 0")
    if abs(sum(ratios) - 1.0) > RATIO_TOLERANCE:
        raise ValueError(f"sharding_ratios sum to {sum(ratios):.9g}; they must sum to 1 "
                         f"(within {RATIO_TOLERANCE:g})")


def check_mesh(plan: PlanParts) -> None:
    mesh = plan.mesh
    nodes, per_node, n = mesh.num_nodes, mesh.per_node, plan.num_devices
    if nodes < 1 or per_node < 1 or nodes * per_node != n or mesh.first_rank != 0:
        raise ValueError(f"mesh {nodes} x {per_node} from rank {mesh.first_rank}: must cover the cluster's "
                         f"{n} devices from rank 0")
    if mesh.two_level != (nodes > 1):
        raise ValueError(f"mesh {nodes} x {per_node}: two_level is {mesh.two_level}; it must be "
                         f"{nodes > 1} (a mesh is two-level exactly when it has more than one node)")
    sizes = list(plan.node_sizes)
    if nodes > 1 and sizes != [per_node] * nodes:
        raise ValueError(f"mesh {nodes} x {per_node}: the cluster's nodes hold {sizes} devices; a two-level "
                         f"mesh needs {nodes} nodes of {per_node}")


def _check_sum(where: str, lengths: Sequence[int], size: int) -> None:
    if sum(lengths) != size:
        raise ValueError(f"{where}: the shard lengths add up to {sum(lengths)}, the dim has {size}")


def _check_split(where: str, layout: Layout, dim: int, lengths: Sequence[int], size: int,
                 mesh: Mesh) -> str:
    """The lengths of one split dim add up to its size, per the axes that split it; returns
    the axis of the split (instruction_set.shards.AXES)."""
    on_outer, on_inner = layout.outer.dim == dim, layout.inner.dim == dim
    nodes, per_node = mesh.num_nodes, mesh.per_node
    if on_outer and on_inner:
        _check_sum(where, lengths, size)
        return "flat"
    if layout.is_two_level and nodes == 1:
        raise ValueError(f"{where}: two-level layout '{layout}' on a one-level mesh {nodes} x {per_node}")
    blocks = [tuple(lengths[j * per_node:(j + 1) * per_node]) for j in range(nodes)]
    if on_outer:
        uneven = [j for j, b in enumerate(blocks) if len(set(b)) > 1]
        if uneven:
            raise ValueError(f"{where}: split across nodes only, but node {uneven[0]}'s ranks hold "
                             f"different lengths {list(blocks[uneven[0]])}")
        _check_sum(where, [b[0] for b in blocks], size)
        return "outer"
    differ = [j for j, b in enumerate(blocks) if b != blocks[0]]
    if differ:
        raise ValueError(f"{where}: split inside nodes only, but node {differ[0]} splits it as "
                         f"{list(blocks[differ[0]])} and node 0 as {list(blocks[0])}")
    _check_sum(where, blocks[0], size)
    return "inner"


def _check_rounding(where: str, lengths: Sequence[int], size: int, axis: str, rounding: Rounding) -> None:
    """lengths == d * (the ratios' split of size / d units along the axis) for a unit d."""
    g = math.gcd(size, *lengths)
    if g == 0:
        return
    for d in (d for d in range(1, math.isqrt(g) + 1) if g % d == 0):
        for unit in {d, g // d}:
            if tuple(unit * u for u in rounding.units(size // unit, axis)) == tuple(lengths):
                return
    expected = [g * u for u in rounding.units(size // g, axis)]
    raise ValueError(f"{where}: lengths {list(lengths)[:16]} are not the plan's sharding ratios rounded "
                     f"(in units of {g}: {expected[:16]})")


def check_shards(plan: PlanParts) -> None:
    shapes = {node.name: node.outputs[0].shape for node in plan.graph.nodes if node.outputs}
    n = plan.num_devices
    rounding = Rounding(plan.ratios, plan.mesh)
    for tensor, layouts in plan.shards.items():
        if tensor not in shapes:
            raise ValueError(f"shards[{tensor!r}]: no tensor of that name in the plan's graph")
        shape = shapes[tensor]
        for layout, dims in layouts.items():
            where = f"shards[{tensor!r}]['{layout}']"
            layout.check(len(shape))
            if set(dims) != set(layout.dims):
                raise ValueError(f"{where}: lengths for dims {sorted(dims)}, the layout splits "
                                 f"dims {list(layout.dims)}")
            for dim, lengths in dims.items():
                at = f"{where}[{dim}] of shape {list(shape)}"
                if len(lengths) != n or any(x < 0 for x in lengths):
                    raise ValueError(f"{at}: needs one length >= 0 per rank ({n}), got {list(lengths)[:16]}")
                axis = _check_split(at, layout, dim, lengths, shape[dim], plan.mesh)
                _check_rounding(at, lengths, shape[dim], axis, rounding)


def _used_layouts(plan: PlanParts) -> list[tuple[str, Layout, str]]:
    """(tensor, layout, instruction) of every layout an instruction reads or writes."""
    inputs = {node.name: node.inputs for node in plan.graph.nodes}
    out = []
    for ins in plan.instructions:
        out.append((ins.tensor, ins.layout, ins.describe()))
        if ins.runs_op and ins.node not in inputs:
            raise ValueError(f"instruction {ins.describe()}: no op {ins.node!r} in the plan's graph")
        if ins.src is not None:
            out.append((ins.src_tensor(inputs.get(ins.node, ())), ins.src, ins.describe()))
        if ins.runs_op:
            out += [(t, layout, ins.describe()) for t, layout in zip(inputs[ins.node], ins.inputs)]
    return out


def check_instructions(plan: PlanParts) -> None:
    names = {node.name for node in plan.graph.nodes}
    for tensor, layout, what in _used_layouts(plan):
        if tensor not in names:
            raise ValueError(f"instruction {what}: no tensor {tensor!r} in the plan's graph")
        if layout.is_shard and layout not in plan.shards.get(tensor, {}):
            raise ValueError(f"instruction {what}: the shard table has no lengths for {tensor}:{layout}")


def check_plan(plan: PlanParts) -> None:
    """Every check above, ratios first."""
    check_ratios(plan.ratios, plan.num_devices)
    check_mesh(plan)
    check_shards(plan)
    check_instructions(plan)
    if plan.num_predicted != plan.num_devices:
        raise ValueError(f"predicted.devices has {plan.num_predicted} entries for {plan.num_devices} devices")
