"""Tensor layouts over the devices of a plan.

A layout says what each rank's local value of a tensor `T` is:

- `R`     Replicate: every rank holds all of `T`.
- `S<d>`  Shard(d): rank `i` holds a contiguous slice of `T` along dim `d`; slice lengths are
          uneven (a plan's per-tensor shard lengths, instruction_set.shards) and may be 0.
- `P`     Partial (sum): the ranks' local values, all of `T`'s shape, sum to `T`.
- `Pmax`  Partial (max): their elementwise maximum is `T` (only for tensors without gradient).

On a cluster of several equal nodes the devices also form a 2-d mesh (nodes x devices per
node, instruction_set.mesh). A two-level layout `A|B` applies placement A across nodes and B
among the devices of each node, each of R, P or S<d>: `S0|R` splits dim 0 over nodes and
replicates it inside a node (data parallelism across nodes), `R|S1` replicates over nodes
and splits dim 1 inside each node (tensor parallelism inside a node), `S0|S2` does both. A
one-level layout is the same placement on both axes: `S<d>` is `S<d>` split over nodes and
the node's block split again over its devices (shards in rank order), `R` is `R|R`, `P` is
`P|P`. Pmax exists one-level only.

Layouts are short strings ("R", "S0", "P", "S0|R") so that search states hash fast and plans
read well. Gradients are dual (HAP, DTensor): the gradient of an `R` tensor is `P`, of `S<d>`
is `S<d>`, of `P` is `R`, per axis, so every communication instruction's backward is its
adjoint.
"""

from __future__ import annotations

Layout = str

R: Layout = "R"
P: Layout = "P"
PMAX: Layout = "Pmax"


def S(dim: int) -> Layout:
    """Shard(dim)."""
    assert dim >= 0, dim
    return f"S{dim}"


def shard_dim(layout: Layout) -> int | None:
    """The sharded dim of a one-level `S<d>` (or of a one-axis placement), else None."""
    return int(layout[1:]) if layout[0] == "S" and "|" not in layout else None


def is_shard(layout: Layout) -> bool:
    """True when some axis splits a dim (one-level S<d>, or A|B with an S component)."""
    return "S" in layout


def axes(layout: Layout) -> tuple[Layout, Layout]:
    """(across nodes, inside a node) placements: 'S0|R' -> ('S0', 'R'); 'S0' -> ('S0', 'S0')."""
    if "|" in layout:
        outer, inner = layout.split("|")
        return outer, inner
    return layout, layout


def join(outer: Layout, inner: Layout) -> Layout:
    """Inverse of axes: equal placements collapse to the one-level layout."""
    return outer if outer == inner else f"{outer}|{inner}"


def is_two_level(layout: Layout) -> bool:
    return "|" in layout


def sharded_dims(layout: Layout) -> tuple[int, ...]:
    """Dims split by some axis, in order, without repeats."""
    dims = []
    for placement in axes(layout):
        d = shard_dim(placement)
        if d is not None and d not in dims:
            dims.append(d)
    return tuple(dims)


def validate(layout: Layout, ndim: int) -> None:
    """Raise ValueError for a layout that is not R, P, Pmax, S<d> with d < ndim, or A|B."""
    if layout == PMAX:
        return
    for placement in axes(layout):
        if placement in (R, P):
            continue
        d = int(placement[1:]) if placement[:1] == "S" and placement[1:].isdigit() else None
        if d is None or d >= ndim:
            raise ValueError(f"layout {layout!r} is not valid for a {ndim}-d tensor; use R, P, "
                             f"Pmax, S0..S{max(ndim - 1, 0)} or two of R/P/S<d> joined by '|'")
