"""Sharding rules: for each supported ATen op, which input layouts give which output layout.

A `Rule` lists one layout per tensor input of a node (in `Node.inputs` order) and the layout
of its output (of every output, for multi-output ops). A rule's `local` names a rewrite of the
op on a rank's shard beyond plain local shapes (instruction_set.local):

- `once:<i>`         input i (a replicated addend or bias) is added on the keeper rank only,
                     so the P output sums to the right value;
- `mean_global`      a mean over a sharded dim becomes a local sum divided by the global count;
- `gather_sharded`   a gather along a sharded dim takes the rows this rank owns (P output);
- `embedding_sharded` a lookup in a vocab-sharded table takes the rows this rank owns (P).

Shape-valued arguments (view sizes, expand sizes) are rewritten to the local output shape by
the runtime for the ops listed in SHAPE_ARG. Ops absent from the registry are unsupported; the
capture reports them (and may accept them as replicated-only "fallback" ops).

Each family module registers its rule functions with `register`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from instruction_set.graph import Node, TensorMeta
from instruction_set.layouts import R, Layout


@dataclass(frozen=True, slots=True)
class Rule:
    inputs: tuple[Layout, ...]
    output: Layout
    local: str = ""


RuleFn = Callable[[Node, tuple[TensorMeta, ...]], list[Rule]]

_REGISTRY: dict[str, RuleFn] = {}

# Ops whose argument at this index is the output shape (rewritten to the local shape).
SHAPE_ARG: dict[str, int] = {}


def register(targets: Iterable[str], fn: RuleFn, *, shape_arg: int | None = None) -> None:
    for target in targets:
        assert target not in _REGISTRY, f"two rule families for {target}"
        _REGISTRY[target] = fn
        if shape_arg is not None:
            SHAPE_ARG[target] = shape_arg


def replicated(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    """Only the replicated rule: every input R, output R, the full op on every rank."""
    return [Rule(tuple(R for _ in metas), R)]


def is_supported(target: str) -> bool:
    return target in _REGISTRY


def supported_targets() -> list[str]:
    return sorted(_REGISTRY)


def rules_for(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    """All rules of a call node; fallback nodes are replicated-only. Always includes all-R."""
    if node.fallback:
        return replicated(node, metas)
    rules = _REGISTRY[node.target](node, metas)
    assert any(r.output == R and all(i == R for i in r.inputs) for r in rules), node.target
    return _dedup(rules)


def _dedup(rules: list[Rule]) -> list[Rule]:
    seen: dict[tuple, Rule] = {}
    for r in rules:
        seen.setdefault((r.inputs, r.output), r)
    return list(seen.values())


def arg(node: Node, index: int, name: str, default=None):
    """A node's non-tensor argument by position or keyword, with a default."""
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, default)


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _load_families() -> None:
    from instruction_set.rules import (  # noqa: F401  (imports register the families)
        attention, contraction, conv, elementwise, embedding, factory, norm, reduction, views,
    )


_load_families()
