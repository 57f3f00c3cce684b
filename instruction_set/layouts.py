"""Tensor layouts over the devices of a plan.

A layout says what each rank's local value of a tensor `T` is:

- `R`     Replicate: every rank holds all of `T`.
- `S<d>`  Shard(d): rank `i` holds a contiguous slice of `T` along dim `d`; slice lengths are
          uneven (a plan's per-tensor shard lengths, instruction_set.shards) and may be 0.
- `P`     Partial (sum): the ranks' local values, all of `T`'s shape, sum to `T`.
- `Pmax`  Partial (max): their elementwise maximum is `T` (only for tensors without gradient).

Layouts are short strings ("R", "S0", "P") so that search states hash fast and plans read
well. Gradients are dual (HAP, DTensor): the gradient of an `R` tensor is `P`, of `S<d>` is
`S<d>`, of `P` is `R`, so every communication instruction's backward is its adjoint.
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
    """The sharded dim of `S<d>`, else None."""
    return int(layout[1:]) if layout[0] == "S" else None


def is_shard(layout: Layout) -> bool:
    return layout[0] == "S"


def is_partial(layout: Layout) -> bool:
    return layout[0] == "P"


def validate(layout: Layout, ndim: int) -> None:
    """Raise ValueError for a layout that is not R, P, Pmax or S<d> with d < ndim."""
    if layout in (R, P, PMAX):
        return
    d = shard_dim(layout) if layout[:1] == "S" and layout[1:].isdigit() else None
    if d is None or d >= ndim:
        raise ValueError(f"layout {layout!r} is not valid for a {ndim}-d tensor; "
                         f"use R, P, Pmax or S0..S{max(ndim - 1, 0)}")
