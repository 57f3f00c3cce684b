"""Elementwise ops, with broadcasting.

Sharding: the output may be sharded on any dim `d` of size > 1; an input whose aligned dim
(numpy broadcasting aligns trailing dims) has the same size is then sharded on it, an input
that broadcasts along `d` (size 1 or missing) stays R.

Partial: an op that is linear in a tensor keeps it Partial when the other operands are R:
  add/sub(P, P) -> P;  add/sub(P, R) -> P with R added on the keeper rank only (`once`);
  mul(P, R), mul(R, P), div(P, R) -> P;  neg/clone/convert(P) -> P.
"""

from __future__ import annotations

from instruction_set.graph import Node, TensorMeta
from instruction_set.layouts import P, R, S
from instruction_set.rules import Rule, register

ADDITIVE = ["aten.add.Tensor", "aten.sub.Tensor"]
SCALING = ["aten.mul.Tensor", "aten.div.Tensor"]
LINEAR_UNARY = [
    "aten.neg.default", "aten.clone.default", "aten.contiguous.default", "aten.alias.default",
    "aten.detach.default", "aten.to.dtype", "aten.to.dtype_layout", "aten._to_copy.default",
    "aten.lift_fresh_copy.default", "aten.zeros_like.default", "aten.type_as.default",
]
NONLINEAR = [
    "aten.exp.default", "aten.log.default", "aten.tanh.default", "aten.gelu.default",
    "aten.relu.default", "aten.silu.default", "aten.sigmoid.default", "aten.sqrt.default",
    "aten.rsqrt.default", "aten.erf.default", "aten.abs.default", "aten.reciprocal.default",
    "aten.square.default", "aten.pow.Tensor_Scalar", "aten.pow.Tensor_Tensor",
    "aten.rsub.Scalar", "aten.rsub.Tensor", "aten.dropout.default", "aten.clamp.default",
    "aten.clamp_min.default", "aten.clamp_max.default", "aten.minimum.default",
    "aten.maximum.default", "aten.where.self", "aten.where.ScalarOther", "aten.where.ScalarSelf",
    "aten.masked_fill.Scalar", "aten.masked_fill.Tensor", "aten.ne.Scalar", "aten.ne.Tensor",
    "aten.eq.Scalar", "aten.eq.Tensor", "aten.lt.Scalar", "aten.lt.Tensor", "aten.gt.Scalar",
    "aten.gt.Tensor", "aten.le.Scalar", "aten.le.Tensor", "aten.ge.Scalar", "aten.ge.Tensor",
    "aten.logical_not.default", "aten.logical_and.default", "aten.logical_or.default",
    "aten.__and__.Tensor", "aten.__or__.Tensor", "aten.bitwise_not.default",
    "aten.bitwise_and.Tensor", "aten.bitwise_or.Tensor", "aten.ones_like.default",
    "aten.full_like.default", "aten.empty_like.default", "aten.silu_.default",
    "aten.relu_.default", "aten.add.Scalar", "aten.sub.Scalar", "aten.mul.Scalar",
    "aten.div.Scalar", "aten.floor_divide.default", "aten.remainder.Scalar", "aten.sin.default",
    "aten.cos.default", "aten.log1p.default", "aten.expm1.default", "aten.sign.default",
    "aten.fill.Scalar", "aten.softplus.default", "aten.hardtanh.default", "aten.leaky_relu.default",
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


def _additive(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    rules = shard_rules(node, metas)
    if len(metas) == 2:
        rules += [Rule((P, P), P), Rule((P, R), P, "once:1"), Rule((R, P), P, "once:0")]
    return rules


def _scaling(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    rules = shard_rules(node, metas)
    if len(metas) == 1:
        return rules + [Rule((P,), P)]
    rules.append(Rule((P, R), P))
    if node.target == "aten.mul.Tensor":
        rules.append(Rule((R, P), P))
    return rules


def _linear_unary(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    rules = shard_rules(node, metas)
    if len(metas) == 1 and node.outputs[0].is_float == metas[0].is_float:
        rules.append(Rule((P,), P))
    return rules


register(ADDITIVE, _additive)
register(SCALING, _scaling)
register(LINEAR_UNARY, _linear_unary)
register(NONLINEAR, shard_rules)
