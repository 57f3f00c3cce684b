"""Tensor layouts over the devices of a plan: typed, interned values.

A `Placement` says what each rank's local value of a tensor `T` is along one mesh axis
(PyTorch DTensor's split, Replicate / Shard / Partial):

- `R`     Replicate: every rank holds all of `T`.
- `S<d>`  Shard(d): rank `i` holds a contiguous slice of `T` along dim `d`; slice lengths are
          uneven (a plan's per-tensor shard lengths, instruction_set.shards) and may be 0.
- `P`     Partial (sum): the ranks' local values, all of `T`'s shape, sum to `T`.
- `Pmax`  Partial (max): their elementwise maximum is `T` (only for tensors without gradient).

A `Layout` is the pair of placements along the plan mesh's two axes (instruction_set.mesh:
across nodes, inside a node). A two-level layout `A|B` applies A across nodes and B among the
devices of each node: `S0|R` splits dim 0 over nodes and replicates it inside a node (data
parallelism across nodes), `R|S1` tensor parallelism inside a node, `S0|S2` both. A one-level
layout is the same placement on both axes: `S<d>` is split over nodes and the node's block
split again over its devices (shards in rank order), `R` is `R|R`, `P` is `P|P`. Pmax exists
one-level only. A layout is relative to a mesh; `MeshLayout` (instruction_set.shards) binds
one to a concrete mesh or sub-mesh.

Gradients are dual (HAP, DTensor): the gradient of an `R` tensor is `P`, of `S<d>` is `S<d>`,
of `P` is `R`, per axis, so every communication instruction's backward is its adjoint.

Both types are interned: equal values are one object, so `==` and `hash` are identity (C
speed in the search's memo tables), attributes are computed once, and the objects survive
pickle and (deep) copy as themselves. `Layout.parse` is the one reader of the text form
("R", "S0", "Pmax", "S0|R"); `str()` writes it, and the plan's JSON holds it (`LayoutField`).
Sorting is by text, so orders (and the search's tie-breaks) are those of the strings.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, final

from pydantic import PlainSerializer, PlainValidator


class PlacementKind(StrEnum):
    REPLICATE = "R"
    SHARD = "S"
    PARTIAL = "P"
    PARTIAL_MAX = "Pmax"


_PLACEMENTS: dict[tuple[PlacementKind, int | None], "Placement"] = {}
_LAYOUTS: dict[tuple["Placement", "Placement"], "Layout"] = {}
_PARSED: dict[str, "Layout"] = {}


class _Interned:
    """Immutable; copies and unpickled copies are the interned object itself."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __copy__(self) -> Any:
        return self

    def __deepcopy__(self, memo: dict) -> Any:
        return self

    def __lt__(self, other: Any) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.text < other.text

    def __gt__(self, other: Any) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.text > other.text

    def __str__(self) -> str:
        return self.text

    def __format__(self, spec: str) -> str:
        return format(self.text, spec)


@final
class Placement(_Interned):
    """Along one mesh axis: Replicate, Shard(dim), Partial (sum pending) or PartialMax."""

    __slots__ = ("kind", "dim", "text", "is_shard", "is_partial")
    kind: PlacementKind
    dim: int | None
    text: str
    is_shard: bool
    is_partial: bool

    def __new__(cls, kind: PlacementKind, dim: int | None = None) -> "Placement":
        found = _PLACEMENTS.get((kind, dim))
        if found is not None:
            return found
        kind = PlacementKind(kind)
        if (kind is PlacementKind.SHARD) != (isinstance(dim, int) and dim >= 0):
            raise ValueError(f"placement {kind.value} with dim {dim!r}: Shard needs a dim >= 0, "
                             f"the others none")
        self = object.__new__(cls)
        for name, value in (("kind", kind), ("dim", dim), ("text", f"S{dim}" if dim is not None else kind.value),
                            ("is_shard", kind is PlacementKind.SHARD),
                            ("is_partial", kind in (PlacementKind.PARTIAL, PlacementKind.PARTIAL_MAX))):
            object.__setattr__(self, name, value)
        return _PLACEMENTS.setdefault((kind, dim), self)

    def __reduce__(self) -> tuple:
        return Placement, (self.kind.value, self.dim)

    def __repr__(self) -> str:
        return f"Placement({self.text})"


def Replicate() -> Placement:
    return Placement(PlacementKind.REPLICATE)


def Shard(dim: int) -> Placement:
    return Placement(PlacementKind.SHARD, dim)


def Partial() -> Placement:
    return Placement(PlacementKind.PARTIAL)


def PartialMax() -> Placement:
    return Placement(PlacementKind.PARTIAL_MAX)


_GRAMMAR = ("R, P, Pmax, S<d> (d >= 0 a tensor dim, e.g. S0) or two of R, P, S<d> joined by '|' "
            "(across nodes|inside a node, e.g. S0|R)")
_PLACEMENT_TEXT = re.compile(r"R|P|Pmax|S(0|[1-9][0-9]*)")


@final
class Layout(_Interned):
    """(across nodes, inside a node) placements; one-level when they are equal."""

    __slots__ = ("outer", "inner", "text", "is_shard", "is_two_level", "shard_dim", "dims")
    outer: Placement
    inner: Placement
    text: str
    is_shard: bool       # some axis splits a dim
    is_two_level: bool   # the axes differ (A|B)
    shard_dim: int | None  # the dim of a one-level S<d>, else None
    dims: tuple[int, ...]  # the dims some axis splits, in order, without repeats

    def __new__(cls, outer: Placement, inner: Placement | None = None) -> "Layout":
        inner = outer if inner is None else inner
        found = _LAYOUTS.get((outer, inner))
        if found is not None:
            return found
        if not (isinstance(outer, Placement) and isinstance(inner, Placement)):
            raise TypeError(f"a Layout is made of Placements, got {outer!r}, {inner!r}")
        two = outer is not inner
        if two and PlacementKind.PARTIAL_MAX in (outer.kind, inner.kind):
            raise ValueError(f"layout '{outer}|{inner}': Pmax exists one-level only; use {_GRAMMAR}")
        self = object.__new__(cls)
        dims = tuple(dict.fromkeys(p.dim for p in (outer, inner) if p.is_shard))
        for name, value in (("outer", outer), ("inner", inner), ("text", f"{outer}|{inner}" if two else outer.text),
                            ("is_shard", outer.is_shard or inner.is_shard), ("is_two_level", two),
                            ("shard_dim", None if two else outer.dim), ("dims", dims)):
            object.__setattr__(self, name, value)
        return _LAYOUTS.setdefault((outer, inner), self)

    @staticmethod
    def parse(text: "str | Layout") -> "Layout":
        """THE reader of a layout's text (a Layout is returned as it is); ValueError naming
        the text and the grammar."""
        if type(text) is Layout:
            return text
        found = _PARSED.get(text) if isinstance(text, str) else None
        if found is None:
            found = _PARSED.setdefault(text, _parse(text))
        return found

    def axis(self, axis: str) -> Placement:
        """The placement along a mesh axis ("outer" or "inner"; "all" of a one-level layout)."""
        if axis == "inner":
            return self.inner
        assert axis == "outer" or not self.is_two_level, (self, axis)
        return self.outer

    def check(self, ndim: int) -> None:
        """ValueError unless every split dim is a dim of an `ndim`-d tensor."""
        if any(d >= ndim for d in self.dims):
            raise ValueError(f"layout {self.text!r} is not valid for a {ndim}-d tensor; use R, P, Pmax, "
                             f"S0..S{max(ndim - 1, 0)} or two of R/P/S<d> joined by '|'")

    def __reduce__(self) -> tuple:
        return Layout.parse, (self.text,)

    def __repr__(self) -> str:
        return f"Layout({self.text})"


def _placement(text: str, whole: str) -> Placement:
    m = _PLACEMENT_TEXT.fullmatch(text)
    if m is None:
        raise ValueError(f"layout {whole!r} is not a layout: {text!r} is no placement; use {_GRAMMAR}")
    return Shard(int(m.group(1))) if m.group(1) is not None else Placement(PlacementKind(text))


def _parse(text: Any) -> Layout:
    if not isinstance(text, str):
        raise ValueError(f"layout {text!r} is not a layout (not text); use {_GRAMMAR}")
    parts = text.split("|")
    if len(parts) > 2:
        raise ValueError(f"layout {text!r} is not a layout: more than two axes; use {_GRAMMAR}")
    return Layout(*(_placement(p, text) for p in parts))


R: Layout = Layout(Replicate())
P: Layout = Layout(Partial())
PMAX: Layout = Layout(PartialMax())
_S: dict[int, Layout] = {}


def S(dim: int) -> Layout:
    """The one-level Shard(dim)."""
    found = _S.get(dim)
    if found is None:
        found = _S.setdefault(dim, Layout(Shard(dim)))
    return found


# A layout in a pydantic model: read from its text (Layout.parse), written as its text.
LayoutField = Annotated[Layout, PlainValidator(Layout.parse), PlainSerializer(str, return_type=str)]
