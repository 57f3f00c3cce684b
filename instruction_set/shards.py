"""Uneven shard lengths, derived once for every tensor dim.

Sharding rules link tensor dims: `add(x S0, y S0) -> S0` links dim 0 of x, y and the output;
`view [B, S, H] S0 -> [B*S, H] S0` links B to B*S with lengths scaled by S. All linked dims
form a *dim class*. Along any chain of links the scale factor is a ratio of dim sizes, so the
lengths of every member follow from one root:

    len(member, rank i) = len(root, i) * size(member) / size(root)

The root is the smallest member. For every member length to be an integer, root lengths are
multiples of the class unit `u = lcm_m(size_root / gcd(size_root, size_m))`, and

    len(root, .) = u * largest_remainder(ratios, size_root / u)

(largest-remainder rounding: floor every `ratio_i * n`, then give the leftover units to the
largest fractional parts, ties to the lower rank). Zero-length shards are legal.
On a two-level mesh (instruction_set.mesh) a layout `A|B` places a dim on one axis or both:
  one-level S<d> (both axes)  rank r holds len(r) of the one-level split above; a node's
                              block is the sum over its devices
  A = S<d> only (across nodes)  every rank of node j holds node j's block of that split
  B = S<d> only (inside nodes)  the whole dim split over a node's devices, the same on every
                              node (by the column sums of the ratios, `inside_ratios`)
`ShardLengths.rank_lengths` gives, for any layout, every sharded dim's local length on every
rank; every consumer of shard lengths (cost model, plan) calls it or `rank_shares`.
`MeshLayout` binds a layout to a mesh or sub-mesh and answers where a rank's slice starts and
whether its copy counts once (the runtime, reports).

A class's root lengths depend on it only through its count of units `root_size / unit`, so
`ShardLengths` rounds once per count and per axis (over all ranks, the node blocks, inside a
node) at fixed ratios and answers every tensor of every class with that count, for all
ranks or only some (the representatives of device classes, cost_models.device_classes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from hetsynth.instruction_set.layouts import Layout
from hetsynth.instruction_set.mesh import Mesh

DimKey = tuple[str, int]  # (tensor name, dim)


def largest_remainder(ratios: Sequence[float], total: int) -> list[int]:
    """Integers proportional to `ratios` summing to `total` (Hamilton's method)."""
    if total < 0:
        raise ValueError(f"cannot split {total} units")
    weight = sum(ratios)
    if weight <= 0 or any(r < 0 for r in ratios):
        raise ValueError(f"ratios must be >= 0 with a positive sum, got {list(ratios)}")
    exact = [r / weight * total for r in ratios]
    out = [math.floor(x + 1e-9) for x in exact]
    leftover = total - sum(out)
    order = sorted(range(len(ratios)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[:max(leftover, 0)]:
        out[i] += 1
    return out


@dataclass
class _UnionFind:
    parent: dict[DimKey, DimKey] = field(default_factory=dict)

    def find(self, x: DimKey) -> DimKey:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: DimKey, b: DimKey) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


@dataclass(frozen=True)
class DimClass:
    root_size: int
    unit: int
    members: tuple[DimKey, ...]


class DimClasses:
    """Classes of linked tensor dims and their shard lengths."""

    def __init__(self, sizes: dict[DimKey, int], links: Iterable[tuple[DimKey, DimKey]]) -> None:
        uf = _UnionFind()
        for key in sizes:
            uf.find(key)
        for a, b in links:
            uf.union(a, b)
        groups: dict[DimKey, list[DimKey]] = {}
        for key in sizes:
            groups.setdefault(uf.find(key), []).append(key)
        self.sizes = sizes
        self.class_of: dict[DimKey, int] = {}
        self.classes: list[DimClass] = []
        for members in groups.values():
            root = min(sizes[m] for m in members)
            unit = math.lcm(*(root // math.gcd(root, sizes[m]) for m in members)) if root else 1  # empty dims
            for m in members:
                self.class_of[m] = len(self.classes)
            self.classes.append(DimClass(root, unit, tuple(members)))

    def lengths(self, tensor: str, dim: int, ratios: Sequence[float]) -> list[int]:
        """Per-rank lengths of `tensor` sharded on `dim` under `ratios`."""
        return list(ShardLengths(self, ratios, Mesh(1, len(ratios), False)).lengths(tensor, dim, "flat"))

    def of(self, tensor: str, dim: int) -> DimClass:
        return self.classes[self.class_of[(tensor, dim)]]

    def shares(self, tensor: str, dim: int, ratios: Sequence[float]) -> list[float]:
        """Fraction of the dim held by each rank."""
        size = self.sizes[(tensor, dim)]
        return [n / size if size else 0.0 for n in self.lengths(tensor, dim, ratios)]

    def class_id(self, tensor: str, dim: int) -> int:
        return self.class_of[(tensor, dim)]


AXES = ("flat", "outer", "inner")  # split over all ranks / across nodes only / inside nodes only


class Rounding:
    """Largest-remainder splits of a count of units at fixed ratios on a mesh, memoised."""

    def __init__(self, ratios: Sequence[float], mesh: Mesh) -> None:
        self.ratios, self.mesh = tuple(ratios), mesh
        self.inside = inside_ratios(ratios, mesh)
        self._units: dict[tuple[int, str], tuple[int, ...]] = {}

    def units(self, count: int, axis: str) -> tuple[int, ...]:
        """Units held by every rank when `count` units are split along `axis`: `flat` over all
        ranks by the ratios; `outer` the rank's node's block of the flat split; `inner` inside
        each node by `inside_ratios`, the same on every node."""
        key = (count, axis)
        if key not in self._units:
            self._units[key] = self._round(count, axis)
        return self._units[key]

    def _round(self, count: int, axis: str) -> tuple[int, ...]:
        mesh = self.mesh
        if axis == "flat":
            return tuple(largest_remainder(self.ratios, count))
        if axis == "outer":
            flat = self.units(count, "flat")
            blocks = [sum(flat[r] for r in mesh.node_ranks(j)) for j in range(mesh.num_nodes)]
            return tuple(blocks[r // mesh.per_node] for r in range(mesh.size))
        inner = largest_remainder(self.inside, count)
        return tuple(inner[r % mesh.per_node] for r in range(mesh.size))


class ShardLengths(Rounding):
    """The shard lengths of every dim class at fixed ratios on a mesh, rounded once per count
    of units and axis. `ranks` (default all) picks whose lengths are returned."""

    def __init__(self, classes: DimClasses, ratios: Sequence[float], mesh: Mesh) -> None:
        super().__init__(ratios, mesh)
        self.classes = classes
        self._lengths: dict[tuple, tuple[int, ...]] = {}

    @property
    def counts(self) -> list[int]:
        """The distinct counts of units `root_size / unit` of the dim classes."""
        return sorted({c.root_size // c.unit for c in self.classes.classes})

    def lengths(self, tensor: str, dim: int, axis: str, ranks: Sequence[int] | None = None) -> tuple[int, ...]:
        """Local lengths of `tensor`'s `dim` split along `axis` (root units times the member's
        scale `size / root_size`)."""
        cls, size = self.classes.of(tensor, dim), self.classes.sizes[(tensor, dim)]
        key = (cls.root_size, cls.unit, size, axis, None if ranks is None else tuple(ranks))
        found = self._lengths.get(key)
        if found is None:
            units = self.units(cls.root_size // cls.unit, axis)
            picked = units if ranks is None else (units[r] for r in ranks)
            if cls.root_size == 0:  # a dim of size 0 (an empty slice): nothing to split
                found = tuple(0 for _ in picked)
            else:
                found = tuple(cls.unit * u * size // cls.root_size for u in picked)
            self._lengths[key] = found  # the same per (class shape, size): a 1,024-rank tuple built once
        return found

    def rank_lengths(self, tensor: str, layout: Layout,
                     ranks: Sequence[int] | None = None) -> dict[int, tuple[int, ...]]:
        """{dim: local length on each rank} for every dim the layout splits."""
        d_out, d_in = layout.outer.dim, layout.inner.dim
        if d_out is not None and d_out == d_in:
            return {d_out: self.lengths(tensor, d_out, "flat", ranks)}
        out: dict[int, tuple[int, ...]] = {}
        if d_out is not None:
            out[d_out] = self.lengths(tensor, d_out, "outer", ranks)
        if d_in is not None:
            out[d_in] = self.lengths(tensor, d_in, "inner", ranks)
        return out

    def rank_shares(self, tensor: str, layout: Layout, ranks: Sequence[int] | None = None) -> tuple[float, ...]:
        """Fraction of the tensor's elements each rank holds (1 for unsplit layouts)."""
        shares = [1.0] * (self.mesh.size if ranks is None else len(ranks))
        for dim, lengths in self.rank_lengths(tensor, layout, ranks).items():
            size = self.classes.sizes[(tensor, dim)]
            shares = [s * n / size if size else 0.0 for s, n in zip(shares, lengths)]
        return tuple(shares)


def inside_ratios(ratios: Sequence[float], mesh: Mesh) -> list[float]:
    """The split inside nodes, the same on every node: local index l gets the sum of the
    ratios of the devices with index l (cross-node collectives pair those devices, so their
    slices must match). Even when all are 0."""
    cols = [sum(ratios[r] for r in mesh.cross_ranks(l)) for l in range(mesh.per_node)]
    return cols if sum(cols) > 0 else [1.0] * mesh.per_node


@dataclass(frozen=True, slots=True)
class MeshLayout:
    """A layout bound to a mesh or sub-mesh (instruction_set.mesh): which of its ranks hold
    which part of a tensor. Per-rank lengths are indexed by member, in mesh order (rank minus
    the mesh's first rank; the rank itself on a whole-cluster mesh)."""

    mesh: Mesh
    layout: Layout

    def offset(self, lengths: Sequence[int], dim: int, rank: int) -> int:
        """Start of `rank`'s slice of `dim`: after the earlier members (one-level split), the
        earlier nodes' blocks (split across nodes only), or the earlier members of its node
        (split inside nodes only)."""
        mesh, i = self.mesh, rank - self.mesh.first_rank
        assert 0 <= i < mesh.size, (rank, mesh)
        split_outer, split_inner = self.layout.outer.dim == dim, self.layout.inner.dim == dim
        if split_outer and split_inner:
            return sum(lengths[:i])
        if split_outer:
            return sum(lengths[j * mesh.per_node] for j in range(mesh.node(rank)))
        node_start = mesh.node(rank) * mesh.per_node
        return sum(lengths[node_start:i])

    def counts_once(self, rank: int) -> bool:
        """Whether `rank`'s copy counts in a global sum: the first replica along every axis
        that does not split the tensor."""
        mesh, layout = self.mesh, self.layout
        if not mesh.two_level:
            return layout.is_shard or rank == mesh.first_rank
        return ((layout.outer.is_shard or mesh.node(rank) == 0)
                and (layout.inner.is_shard or mesh.local(rank) == 0))

    def group(self, axis: str, rank: int) -> range:
        """The ranks sharing `rank`'s collective along a mesh axis."""
        return self.mesh.members(axis, rank)

    def __str__(self) -> str:
        ranks = self.mesh.ranks
        return f"{self.layout} on ranks {ranks.start}..{ranks.stop - 1}"
