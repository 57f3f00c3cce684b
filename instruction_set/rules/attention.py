"""Scaled dot-product attention: q, k, v are [B, H, L, E].

Batch split: q, k, v S0 (and a mask S0 when it has a batch dim > 1, else R) -> S0.
Head-parallel: q, k, v S1 (a mask S1 when it has a head dim > 1, else R) -> S1.
The sequence dims are never split (softmax reduces over keys, causal masks index queries).
"""

from __future__ import annotations

from instruction_set.graph import Node, TensorMeta
from instruction_set.layouts import R, S
from instruction_set.rules import Rule, register


def _sdpa(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    q, k, v = metas[:3]
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        return [Rule((R,) * len(metas), R)]  # grouped-query attention: replicated only
    rules = [Rule((R,) * len(metas), R)]
    for d in (0, 1):
        if q.shape[d] <= 1:
            continue
        masks = []
        for m in metas[3:]:
            k_dim = d - (4 - len(m.shape))
            masks.append(S(k_dim) if k_dim >= 0 and m.shape[k_dim] == q.shape[d] else R)
        rules.append(Rule((S(d),) * 3 + tuple(masks), S(d)))
    return rules


register(["aten.scaled_dot_product_attention.default"], _sdpa)
