"""Normalisations and softmax: shardable on every dim they do not reduce over.

layer_norm(x, normalized_shape, w, b): x sharded on a leading (not normalised) dim, w and b R.
softmax / log_softmax(x, dim): x sharded on any dim but `dim`.
"""

from __future__ import annotations

from hetsynth.instruction_set.graph import Node, TensorMeta
from hetsynth.instruction_set.layouts import R, S
from hetsynth.instruction_set.rules.registry import Rule, arg, norm_dim, register


def _layer_norm(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    shape = metas[0].shape
    lead = len(shape) - len(arg(node, 1, "normalized_shape"))
    rest = (R,) * (len(metas) - 1)
    rules = [Rule((R,) + rest, R)]
    rules += [Rule((S(d),) + rest, S(d)) for d in range(lead) if shape[d] > 1]
    return rules


def _softmax(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    shape = metas[0].shape
    dim = norm_dim(arg(node, 1, "dim"), len(shape))
    rules = [Rule((R,), R)]
    rules += [Rule((S(d),), S(d)) for d, s in enumerate(shape) if d != dim and s > 1]
    return rules


register(["aten.layer_norm.default", "aten.rms_norm.default", "aten.native_layer_norm.default"], _layer_norm)
register(["aten.softmax.int", "aten._softmax.default", "aten.log_softmax.int",
          "aten._log_softmax.default"], _softmax)
