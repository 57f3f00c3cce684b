"""Embedding lookup: out[..., h] = weight[idx[...], h].

Token split:   weight R, idx S(d) -> S(d).
Hidden split:  weight S1, idx R -> S(last) (HAP's hidden-split embedding).
Vocab-parallel: weight S0, idx R -> P; each rank looks up the ids it owns and writes zeros
               for the others (`embedding_sharded`), so the ranks' results sum to the lookup.
"""

from __future__ import annotations

from hetsynth.instruction_set.graph import Node, TensorMeta
from hetsynth.instruction_set.layouts import P, R, S
from hetsynth.instruction_set.rules.registry import Rule, register


def _embedding(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    weight, idx = metas[:2]
    out_nd = len(node.outputs[0].shape)
    rules = [Rule((R, R), R)]
    rules += [Rule((R, S(d)), S(d)) for d, s in enumerate(idx.shape) if s > 1]
    if weight.shape[1] > 1:
        rules.append(Rule((S(1), R), S(out_nd - 1)))
    if weight.shape[0] > 1:
        rules.append(Rule((S(0), R), P, "embedding_sharded"))
    return rules


register(["aten.embedding.default"], _embedding)
