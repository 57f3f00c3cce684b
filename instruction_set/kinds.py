"""Instruction kinds of the distributed program: one registry, one entry per kind.

An entry says, for one kind, its Hoare-triple pattern along one mesh axis (the placement it
reads and the one it makes), its adjoint (the kind its backward pass runs), its implementation
variants (the first is the default), the phases it appears in, the mesh axes it may run along,
and what sort of work it is (`Category`):

  storage        a graph input placed in its storage layout (param, input, buffer)
  compute        an op on local shards
  communication  a collective (later point-to-point) along a mesh axis
  local          a layout change without communication (slice, partial)
  fused          communication and compute in one instruction (sfb, ag_matmul, matmul_rs)

    kind            category       pattern      variants                adjoint
    all_gather      communication  S(d) -> R    padded, grouped, ring   reduce_scatter
    reduce_scatter  communication  P -> S(d)    padded, grouped, ring   all_gather
    all_reduce      communication  P -> R       ring, hierarchical      all_reduce (backward: gradient sync)
    all_reduce_max  communication  Pmax -> R    ring                    - (no gradient; axis all only)
    all_to_all      communication  S(i) -> S(j) native                  all_to_all
    slice           local          R -> S(d)    local                   - (backward zero-pads, local)
    partial         local          R -> P       local                   - (backward masks, local)
    sfb             fused          backward of a linear: dW rebuilt from all-gathered factors
    ag_matmul       fused          S(d) -> R    ring, sliced2, sliced4  matmul_rs (all-gather feeding a linear)
    matmul_rs       fused          P -> S(d)    ring, sliced2, sliced4  ag_matmul (a linear's Partial, scattered)

Layers register their implementation of a kind in an `Implementations` registry (the cost
model its cost term, the runtime its emitter and conversion), the way rules register for ops;
asking one for a kind it lacks raises `MissingImplementation` naming the kind and what is
registered. A new kind is one `register_kind` plus those registrations.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Callable, Generic, Iterable, TypeVar

from hetsynth.instruction_set.layouts import PlacementKind
from hetsynth.instruction_set.mesh import MeshAxis

F = TypeVar("F")


class Category(StrEnum):
    STORAGE = "storage"
    COMPUTE = "compute"
    COMMUNICATION = "communication"
    LOCAL = "local"
    FUSED = "fused"


class Phase(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class InstructionKind:
    """One kind of instruction: its pattern along one mesh axis (`source` -> `target`
    placement kinds), backward, variants, phases, axes and category."""

    name: str
    category: Category
    source: PlacementKind | None = None
    target: PlacementKind | None = None
    variants: tuple[str, ...] = ()
    adjoint: str | None = None
    phases: frozenset[Phase] = frozenset({Phase.FORWARD})
    axes: frozenset[MeshAxis] = frozenset(MeshAxis)
    gradient: bool | None = None  # False: only for tensors without gradient
    doc: str = ""

    def adjoint_variant(self, variant: str) -> tuple["InstructionKind", str] | None:
        """(adjoint kind, its variant): the same variant where the adjoint has it, else its first."""
        if self.adjoint is None:
            return None
        back = kind(self.adjoint)
        return back, variant if variant in back.variants else back.variants[0]


class UnknownKind(ValueError):
    """An instruction kind that is not registered; the message lists the registered ones."""


_KINDS: dict[str, InstructionKind] = {}
_CONVERSIONS: dict[tuple[PlacementKind, PlacementKind], InstructionKind] = {}


def register_kind(k: InstructionKind) -> InstructionKind:
    """Add a kind; its name, and the pattern of a forward layout change, must be new."""
    assert k.name not in _KINDS, f"instruction kind {k.name!r} registered twice"
    _KINDS[k.name] = k
    if k.category in (Category.COMMUNICATION, Category.LOCAL) and k.source and k.target:
        assert (k.source, k.target) not in _CONVERSIONS, f"two kinds turn {k.source} into {k.target}"
        _CONVERSIONS[(k.source, k.target)] = k
    return k


def kind(name: str) -> InstructionKind:
    if name not in _KINDS:
        raise UnknownKind(f"unknown instruction kind {name!r}; registered kinds: {', '.join(sorted(_KINDS))}")
    return _KINDS[name]


def known_kind(name: str) -> str:
    """`name` if it is a registered kind (the plan's validator); raises UnknownKind."""
    return kind(name).name


def kinds(category: Category | None = None) -> tuple[InstructionKind, ...]:
    return tuple(k for k in _KINDS.values() if category is None or k.category is category)


def conversion_kind(source: PlacementKind, target: PlacementKind) -> InstructionKind | None:
    """The forward layout change turning placement kind `source` into `target` along one axis."""
    return _CONVERSIONS.get((source, target))


class MissingImplementation(ValueError):
    """A layer has no implementation of an instruction kind (in this phase or variant)."""


class Implementations(Generic[F]):
    """One layer's implementations of instruction kinds, keyed (kind, phase, variant); variant
    None serves every variant of the kind."""

    def __init__(self, layer: str) -> None:
        self.layer = layer
        self._impl: dict[tuple[str, Phase, str | None], F] = {}

    def register(self, name: str, fn: F, *, phase: Phase = Phase.FORWARD, variant: str | None = None) -> F:
        k = kind(name)
        assert phase in k.phases, f"{name} has no {phase} phase"
        assert variant is None or variant in k.variants, f"{name} has no variant {variant!r}"
        assert (name, phase, variant) not in self._impl, f"{self.layer} for {name} ({phase}) registered twice"
        self._impl[(name, phase, variant)] = fn
        return fn

    def implements(self, *names: str, phase: Phase = Phase.FORWARD,
                   variant: str | None = None) -> Callable[[F], F]:
        def add(fn: F) -> F:
            for name in names:
                self.register(name, fn, phase=phase, variant=variant)
            return fn
        return add

    def get(self, name: str, *, phase: str = Phase.FORWARD, variant: str | None = None) -> F:
        for key in ((name, Phase(phase), variant), (name, Phase(phase), None)):
            if key in self._impl:
                return self._impl[key]
        what = f"{name!r} ({phase}{', variant ' + variant if variant else ''})"
        raise MissingImplementation(f"no {self.layer} for instruction kind {what}; {self.layer} exists "
                                    f"for: {self.registered()}")

    def registered(self) -> str:
        return ", ".join(f"{n} ({p}{', ' + v if v else ''})" for n, p, v in sorted(self._impl, key=str))

    def missing(self, keys: Iterable[tuple[str, str, str | None]]) -> list[tuple[str, str, str | None]]:
        """The (kind, phase, variant) keys without an implementation, each once, in order."""
        out: list[tuple[str, str, str | None]] = []
        for name, phase, variant in keys:
            found = (name, Phase(phase), variant) in self._impl or (name, Phase(phase), None) in self._impl
            if not found and (name, phase, variant) not in out:
                out.append((name, phase, variant))
        return out


GATHER_VARIANTS = ("padded", "grouped", "ring")
FUSED_VARIANTS = ("ring", "sliced2", "sliced4")  # CommFuse's ring, and k-slicing (one collective per slice)


def fused_slices(variant: str) -> int:
    """The slices k of a fused variant: 0 for the ring, k for "slicedk"."""
    if variant not in FUSED_VARIANTS:
        raise ValueError(f"unknown fused variant {variant!r}; valid: {', '.join(FUSED_VARIANTS)}")
    return 0 if variant == "ring" else int(variant.removeprefix("sliced"))


_R, _S, _P, _PMAX = PlacementKind.REPLICATE, PlacementKind.SHARD, PlacementKind.PARTIAL, PlacementKind.PARTIAL_MAX
BOTH = frozenset({Phase.FORWARD, Phase.BACKWARD})

for _k in (
    InstructionKind("param", Category.STORAGE, doc="a parameter's local slice in its storage layout"),
    InstructionKind("input", Category.STORAGE, doc="a rank's rows of the batch"),
    InstructionKind("buffer", Category.STORAGE, doc="a buffer in its storage layout"),
    InstructionKind("compute", Category.COMPUTE, doc="the op of `node` on local shards (layouts from its rule)"),
    InstructionKind("sfb", Category.FUSED, variants=GATHER_VARIANTS, phases=frozenset({Phase.BACKWARD}),
                    doc="backward of a linear: the replicated weight's gradient rebuilt from all-gathered factors"),
    InstructionKind("ag_matmul", Category.FUSED, _S, _R, FUSED_VARIANTS, "matmul_rs",
                    doc="a linear whose first input is all-gathered S(d) -> R in ring steps under its chunks' matmuls"),
    InstructionKind("matmul_rs", Category.FUSED, _P, _S, FUSED_VARIANTS, "ag_matmul",
                    doc="a linear whose Partial output is reduce-scattered P -> S(d) in ring steps under its chunks' matmuls"),
    InstructionKind("all_gather", Category.COMMUNICATION, _S, _R, GATHER_VARIANTS, "reduce_scatter"),
    InstructionKind("reduce_scatter", Category.COMMUNICATION, _P, _S, GATHER_VARIANTS, "all_gather"),
    InstructionKind("all_reduce", Category.COMMUNICATION, _P, _R, ("ring", "hierarchical"), "all_reduce", BOTH,
                    doc="backward phase: gradient sync of a replicated parameter, in buckets"),
    InstructionKind("all_reduce_max", Category.COMMUNICATION, _PMAX, _R, ("ring",), axes=frozenset({MeshAxis.ALL}),
                    gradient=False),
    InstructionKind("all_to_all", Category.COMMUNICATION, _S, _S, ("native",), "all_to_all"),
    InstructionKind("slice", Category.LOCAL, _R, _S, ("local",), doc="backward zero-pads (local)"),
    InstructionKind("partial", Category.LOCAL, _R, _P, ("local",), doc="backward masks (local)"),
):
    register_kind(_k)
