"""Elementwise ops, with broadcasting: one rule for all of them.

Every functional op ATen tags `torch.Tag.pointwise` (add, mul, exp, where, gelu, the
comparisons, ...; registered as a tag family) and the untagged elementwise ops of ELEMENTWISE
(dtype conversions, aliases, fills, dropout and other random draws) get `pointwise_rules`
(a random draw keeps the values one device draws: instruction_set.local.draw_whole):

Sharding: the output may be sharded on any dim `d` of size > 1; an input whose aligned dim
(numpy broadcasting aligns trailing dims) has the same size is then sharded on it, an input
that broadcasts along `d` (size 1 or missing) stays R.

Partial: an op that is linear in a tensor keeps it Partial when the other operands are R
(LINEARITY):
  additive  add/sub(P, P) -> P;  add/sub(P, R) -> P with R added on the keeper rank only (`once`);
  bilinear  mul(P, R), mul(R, P) -> P;
  first     div(P, R) -> P (linear in the numerator);
  unary     neg, clone, mul/div by a scalar, conversions between float dtypes, aliases,
            zeros_like: P -> P.
"""

from __future__ import annotations

import torch

from hetsynth.instruction_set.graph import Node, TensorMeta
from hetsynth.instruction_set.layouts import P, R, S
from hetsynth.instruction_set.rules.registry import Rule, register, register_tag

ADDITIVE, BILINEAR, FIRST, UNARY = "additive", "bilinear", "first", "unary"

LINEARITY: dict[str, str] = {
    "aten.add.Tensor": ADDITIVE, "aten.sub.Tensor": ADDITIVE, "aten.mul.Tensor": BILINEAR,
    "aten.div.Tensor": FIRST, "aten.neg.default": UNARY, "aten.clone.default": UNARY,
    "aten.mul.Scalar": UNARY, "aten.div.Scalar": UNARY, "aten.alias.default": UNARY,
    "aten.detach.default": UNARY, "aten._to_copy.default": UNARY, "aten.to.dtype": UNARY,
    "aten.to.dtype_layout": UNARY, "aten.contiguous.default": UNARY,
    "aten.lift_fresh_copy.default": UNARY, "aten.zeros_like.default": UNARY,
    "aten.type_as.default": UNARY,
}

# Elementwise ops without the pointwise tag (conversions, aliases, fills, dropout, polar).
ELEMENTWISE = [
    "aten._to_copy.default", "aten.alias.default", "aten.detach.default", "aten.fill.Scalar",
    "aten.full_like.default", "aten.zeros_like.default", "aten.ones_like.default",
    "aten.empty_like.default", "aten.copy.default", "aten.native_dropout.default",
    "aten.lift_fresh_copy.default", "aten.masked_fill.Tensor", "aten.to.dtype",
    "aten.to.dtype_layout", "aten.contiguous.default", "aten.type_as.default",
    "aten.dropout.default", "aten.bernoulli.p", "aten.rand_like.default", "aten.randn_like.default",
    "aten.exponential.default", "aten.uniform.default", "aten.polar.default",
]


def shard_rules(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    """All-R plus, for each output dim of size > 1, the broadcast-aligned shard rule."""
    out = node.outputs[0].shape
    rules = [Rule(tuple(R for _ in metas), R)]
    for d, size in enumerate(out):
        if size <= 1:
            continue
        layouts = []
        for m in metas:
            k = d - (len(out) - len(m.shape))
            layouts.append(S(k) if k >= 0 and m.shape[k] == size else R)
        rules.append(Rule(tuple(layouts), S(d)))
    return rules


def _partial_rules(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    """Partial rules of the ops in LINEARITY (the tensor inputs are metas, in order)."""
    kind = LINEARITY.get(node.target)
    if kind == ADDITIVE and len(metas) == 2:
        return [Rule((P, P), P), Rule((P, R), P, "once:1"), Rule((R, P), P, "once:0")]
    if kind == BILINEAR and len(metas) == 2:
        return [Rule((P, R), P), Rule((R, P), P)]
    if kind == FIRST and len(metas) == 2:
        return [Rule((P, R), P)]
    first_is_tensor = bool(node.args) and isinstance(node.args[0], dict)
    unary = kind == UNARY or (kind in (BILINEAR, FIRST) and first_is_tensor)
    if unary and len(metas) == 1 and node.outputs[0].is_float == metas[0].is_float:
        return [Rule((P,), P)]
    return []


def pointwise_rules(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    return shard_rules(node, metas) + _partial_rules(node, metas)


register(ELEMENTWISE, pointwise_rules)
register_tag(torch.Tag.pointwise, pointwise_rules)
