"""Sharding rules: for each supported ATen op, which input layouts give which output layout.

A `Rule` lists one layout per tensor input of a node (in `Node.inputs` order) and the layout
of its output (of every output, for multi-output ops). A rule's `local` names a rewrite of the
op on a rank's shard beyond plain local shapes (instruction_set.local):

- `once:<i>`         input i (a replicated addend or bias) is added on the keeper rank only,
                     so the P output sums to the right value;
- `mean_global`      a mean over a sharded dim becomes a local sum divided by the global count;
- `gather_sharded`   a gather along a sharded dim takes the rows this rank owns (P output);
- `embedding_sharded` a lookup in a vocab-sharded table takes the rows this rank owns (P);
- `experts_sharded` / `experts_dispatched` routed experts on a rank holding some of them
                     (instruction_set.experts_op).

A rule's `work_inputs` (empty for most) names the inputs whose split is the op's work and whose
dims form their own ratio class: by default every split entry of a rule is one class (a rank's
rows of x must be its rows of the output) and a rank's work is its smallest share; the
routed-experts op with tokens and experts both split takes its tokens at one ratio and its
experts at another, and its work follows the experts (the pairs routed to them).

Shape-valued arguments (view sizes, expand sizes) are rewritten to the local output shape by
the runtime for the ops listed in SHAPE_ARG. Ops absent from the registry are unsupported; the
capture reports them (and may accept them as replicated-only "fallback" ops).

Each family module registers its rule functions with `register` (by op) or `register_tag` (every
functional op carrying an ATen tag, such as `torch.Tag.pointwise`: one rule for all of them).
The op surface these rules cover is listed in instruction_set.rules.surface. The package's
`__init__` loads the families (kept apart from this module, so no import runs in a circle).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterable

import torch

from hetsynth.instruction_set.graph import Node, TensorMeta
from hetsynth.instruction_set.interpret import resolve_target
from hetsynth.instruction_set.layouts import PMAX, R, Layout


@dataclass(frozen=True, slots=True)
class Rule:
    inputs: tuple[Layout, ...]
    output: Layout
    local: str = ""
    pair: tuple["Rule", "Rule"] | None = None  # (across nodes, inside a node) of a two-level rule
    work_inputs: tuple[int, ...] = ()  # see the module docstring


def product_rule(outer: Rule, inner: Rule) -> Rule | None:
    """The two-level rule applying `outer` across nodes and `inner` inside each node.

    Layouts pair their one-level placements per input and for the output
    (`Layout(outer, inner)`; equal ones stay one-level). A local rewrite
    present on one axis only is tagged with it: `once:1@outer` adds input 1 on the ranks of
    node 0 only, `once:1@inner` on local rank 0 of every node; on both axes it stays `once:1`
    (rank 0 only). Pmax exists one-level only, so rules mixing it are dropped."""
    layouts = list(zip(outer.inputs, inner.inputs)) + [(outer.output, inner.output)]
    if any((a is PMAX) != (b is PMAX) for a, b in layouts):
        return None
    return Rule(tuple(Layout(a.outer, b.outer) for a, b in zip(outer.inputs, inner.inputs)),
                Layout(outer.output.outer, inner.output.outer), _join_local(outer.local, inner.local), (outer, inner),
                inner.work_inputs or outer.work_inputs)


def _join_local(outer: str, inner: str) -> str:
    if outer == inner:
        return outer
    parts = []
    for local, axis in ((outer, "outer"), (inner, "inner")):
        if local:
            parts.append(f"{local}@{axis}" if local.startswith("once:") else local)
    return ",".join(parts)


RuleFn = Callable[[Node, tuple[TensorMeta, ...]], list[Rule]]

_REGISTRY: dict[str, RuleFn] = {}

# Ops whose argument at this index is the output shape (rewritten to the local shape).
SHAPE_ARG: dict[str, int] = {}


_TAGGED: dict[torch.Tag, RuleFn] = {}


def register(targets: Iterable[str], fn: RuleFn, *, shape_arg: int | None = None) -> None:
    for target in targets:
        assert target not in _REGISTRY, f"two rule families for {target}"
        _REGISTRY[target] = fn
        if shape_arg is not None:
            SHAPE_ARG[target] = shape_arg


def register_tag(tag: torch.Tag, fn: RuleFn) -> None:
    """Rules for every functional (not in-place) op carrying `tag`."""
    assert tag not in _TAGGED, f"two rule families for {tag}"
    _TAGGED[tag] = fn


@lru_cache(maxsize=None)
def _rule_fn(target: str) -> RuleFn | None:
    fn = _REGISTRY.get(target)
    if fn is not None:
        return fn
    try:
        tags = set(resolve_target(target).tags)
    except (AttributeError, ValueError):  # getitem, higher-order ops, unknown names
        return None
    if torch.Tag.inplace in tags:
        return None
    return next((f for tag, f in _TAGGED.items() if tag in tags), None)


def replicated(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    """Only the replicated rule: every input R, output R, the full op on every rank."""
    return [Rule(tuple(R for _ in metas), R)]


def is_supported(target: str) -> bool:
    return _rule_fn(target) is not None


def registered_targets() -> list[str]:
    """Ops registered by name (tag families cover more, see is_supported)."""
    return sorted(_REGISTRY)


def rules_for(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    """All rules of a call node; fallback nodes are replicated-only. Always includes all-R."""
    if node.fallback:
        return replicated(node, metas)
    fn = _rule_fn(node.target)
    if fn is None:
        raise KeyError(f"no sharding rule for {node.target} ({node.name})")
    rules = fn(node, metas)
    assert any(r.output is R and all(i is R for i in r.inputs) for r in rules), node.target
    return [r for r in _dedup(rules) if _partials_are_float(r, node, metas)]


def _partials_are_float(rule: Rule, node: Node, metas: tuple[TensorMeta, ...]) -> bool:
    """Partial sums are kept for floating-point tensors only."""
    if rule.output.outer.is_partial and not node.outputs[0].is_float:
        return False
    return all(not layout.outer.is_partial or m.is_float for layout, m in zip(rule.inputs, metas))


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
