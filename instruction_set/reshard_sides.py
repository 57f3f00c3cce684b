"""The one adapter from layouts to resharding sides: a (sub-)mesh, a layout and its per-rank
shard lengths become the box each member rank holds (instruction_set.resharding works on boxes
only). Also the checks of a user's request, each error naming the tensor, both layouts and both
meshes.

For a member at index i of its mesh and a dim d:
  d split by the layout   start = MeshLayout(mesh, layout).offset(lengths[d], d, rank) (the codegen's
                          offset rule: one-level, across nodes or inside nodes), stop = start +
                          lengths[d][i]
  otherwise               [0, shape[d])
A Partial (P) source gives every member the whole tensor, flagged `partial`.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, NamedTuple, Sequence

from hetsynth.instruction_set.layouts import P, PMAX, Layout
from hetsynth.instruction_set.mesh import Mesh
from hetsynth.instruction_set.resharding import Box, ReshardError, ReshardSpec, TensorSide
from hetsynth.instruction_set.shards import MeshLayout


class Placed(NamedTuple):
    """A tensor's layout on a (sub-)mesh with the per-member lengths of every split dim."""

    mesh: Mesh
    layout: Layout
    lengths: Mapping[int, Sequence[int]]


def describe(placed: Placed, hosts: Sequence[int]) -> str:
    ranks = placed.mesh.ranks
    on = sorted({hosts[r] for r in ranks})
    return (f"layout {placed.layout} on ranks {ranks[0]}-{ranks[-1]} "
            f"(host{'s' if len(on) > 1 else ''} {', '.join(map(str, on))})")


def reshard_spec(tensor: str, shape: Sequence[int], dtype: str, itemsize: int, src: Placed, dst: Placed,
                 hosts: Sequence[int], *, dst_shape: Sequence[int] | None = None,
                 dst_dtype: str | None = None) -> ReshardSpec:
    """Check the request and build the spec; `hosts[r]` is global rank r's host."""
    shape = tuple(shape)
    src, dst = _typed(src, tensor), _typed(dst, tensor)
    where = (f"tensor {tensor!r} {list(shape)} {dtype} from {describe(src, hosts)} "
             f"to {describe(dst, hosts)}")
    if dst_shape is not None and (tuple(dst_shape) != shape or (dst_dtype or dtype) != dtype):
        raise ReshardError(f"{where}: source is {list(shape)} {dtype}, destination expects "
                           f"{list(dst_shape)} {dst_dtype or dtype}")
    for role, placed in (("source", src), ("destination", dst)):
        _check_placed(role, placed, shape, where, len(hosts))
    return ReshardSpec(tensor=tensor, shape=shape, dtype=dtype, itemsize=itemsize,
                       src=_side(src, shape, hosts), dst=_side(dst, shape, hosts))


def _typed(placed: Placed, tensor: str) -> Placed:
    """`placed` with its layout read by the one parser (text is accepted)."""
    try:
        return placed._replace(layout=Layout.parse(placed.layout))
    except ValueError as err:
        raise ReshardError(f"tensor {tensor!r}: {err}") from None


def _check_placed(role: str, placed: Placed, shape: tuple[int, ...], where: str, world: int) -> None:
    mesh, layout = placed.mesh, placed.layout
    if mesh.ranks[-1] >= world:
        raise ReshardError(f"{where}: {role} ranks end at {mesh.ranks[-1]}, the cluster has {world}")
    try:
        layout.check(len(shape))
    except ValueError as err:
        raise ReshardError(f"{where}: {role} layout does not fit the tensor: {err}") from None
    partial = layout.outer.is_partial or layout.inner.is_partial
    if layout is PMAX or (role == "source" and partial and layout is not P):
        raise ReshardError(f"{where}: {role} layout {layout}: reduce it on the source first "
                           f"(a resharding takes R, S<d>, A|B of R/S<d>, or a one-level P source)")
    if role == "destination" and partial:
        raise ReshardError(f"{where}: destination layout {layout}: a resharding makes R or S layouts")
    if layout.is_two_level and not mesh.two_level:
        raise ReshardError(f"{where}: {role} layout {layout} is two-level, its mesh (ranks "
                           f"{mesh.ranks[0]}-{mesh.ranks[-1]}) is one-level; use a one-level layout")
    _check_lengths(role, placed, shape, where)


def _check_lengths(role: str, placed: Placed, shape: tuple[int, ...], where: str) -> None:
    dims, given = placed.layout.dims, dict(placed.lengths)
    if set(given) != set(dims):
        raise ReshardError(f"{where}: {role} lengths are given for dims {sorted(given)}, "
                           f"layout {placed.layout} splits dims {list(dims)}")
    mesh = placed.mesh
    for d in dims:
        lengths = tuple(given[d])
        if len(lengths) != mesh.size or any(n < 0 for n in lengths):
            raise ReshardError(f"{where}: {role} lengths of dim {d} {list(lengths)}: need {mesh.size} "
                               f"lengths >= 0, one per rank")
        total = _covered(lengths, placed.layout, d, mesh)
        if total is None:
            raise ReshardError(f"{where}: {role} lengths of dim {d} {list(lengths)} (layout "
                               f"{placed.layout}) differ where ranks share a slice (equal per node "
                               f"across nodes, equal per local index inside nodes)")
        if total != shape[d]:
            raise ReshardError(f"{where}: {role} lengths of dim {d} {list(lengths)} (layout "
                               f"{placed.layout}) add up to {total}, the dim has {shape[d]}")


def _covered(lengths: tuple[int, ...], layout: Layout, dim: int, mesh: Mesh) -> int | None:
    """How much of the dim the lengths cover, or None when ranks that must hold the same slice
    length (a node's ranks for an across-nodes split, a local index for an inside split) differ."""
    split_outer, split_inner = layout.outer.dim == dim, layout.inner.dim == dim
    if split_outer and split_inner:
        return sum(lengths)
    per, nodes = mesh.per_node, mesh.num_nodes
    rows = [lengths[j * per:(j + 1) * per] for j in range(nodes)]
    if split_outer:
        return sum(row[0] for row in rows) if all(len(set(row)) == 1 for row in rows) else None
    return sum(rows[0]) if all(row == rows[0] for row in rows) else None


def _side(placed: Placed, shape: tuple[int, ...], hosts: Sequence[int]) -> TensorSide:
    mesh = placed.mesh
    base = dataclasses.replace(mesh, first_rank=0)
    boxes = []
    for i in range(mesh.size):
        start, stop = [0] * len(shape), list(shape)
        for d, lengths in placed.lengths.items():
            start[d] = MeshLayout(base, placed.layout).offset(tuple(lengths), d, i)
            stop[d] = start[d] + lengths[i]
        boxes.append(Box(start=tuple(start), stop=tuple(stop)))
    return TensorSide(ranks=tuple(mesh.ranks), hosts=tuple(hosts[r] for r in mesh.ranks), boxes=tuple(boxes),
                      partial=placed.layout is P, describe=describe(placed, hosts))
