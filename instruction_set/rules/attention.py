"""Scaled dot-product attention: q is [B, Hq, L, E], k and v are [B, Hkv, S, E].

Batch split: q, k, v S0 (and a mask S0 when it has a batch dim > 1, else R) -> S0.
Head-parallel: q, k, v S1 (a mask S1 when it has a head dim > 1, else R) -> S1.
Grouped-query attention (Hkv < Hq, `enable_gqa`: query head h reads key/value head
h // (Hq / Hkv)) splits by key/value head groups: the head dims of q (Hq) and of k, v (Hkv)
are linked, so shard lengths keep the ratio Hq / Hkv (instruction_set.shards: the class unit
makes every rank hold whole groups, its query heads with their key/value head; uneven and
zero-length shards allowed) and the rank-local op is the same grouped attention. With a
single key/value head (multi-query attention) the query heads split and k, v stay R.
The sequence dims are never split (softmax reduces over keys, causal masks index queries).
"""

from __future__ import annotations

from hetsynth.instruction_set.graph import Node, TensorMeta
from hetsynth.instruction_set.layouts import R, S
from hetsynth.instruction_set.rules.registry import Rule, arg, register


def _grouped(q: TensorMeta, kv: TensorMeta) -> bool:
    return kv.shape[1] > 0 and q.shape[1] % kv.shape[1] == 0


def _masks(metas: tuple[TensorMeta, ...], q: TensorMeta, d: int) -> tuple[str, ...]:
    """A mask is split with q on dim d when it has that dim (aligned from the right), else R."""
    out = []
    for m in metas[3:]:
        k_dim = d - (4 - len(m.shape))
        out.append(S(k_dim) if k_dim >= 0 and m.shape[k_dim] == q.shape[d] else R)
    return tuple(out)


def _sdpa(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    q, k, v = metas[:3]
    rules = [Rule((R,) * len(metas), R)]
    gqa = bool(arg(node, 7, "enable_gqa", False))
    same_batch = q.shape[0] == k.shape[0] == v.shape[0]
    heads_ok = k.shape[1] == v.shape[1] and (q.shape[1] == k.shape[1] or (gqa and _grouped(q, k)))
    for d, ok in ((0, same_batch), (1, heads_ok)):
        if ok and q.shape[d] > 1 and k.shape[d] > 1:
            rules.append(Rule((S(d),) * 3 + _masks(metas, q, d), S(d)))
    if gqa and k.shape[1] == v.shape[1] == 1 and q.shape[1] > 1:
        rules.append(Rule((S(1), R, R) + _masks(metas, q, 1), S(1)))
    return rules


register(["aten.scaled_dot_product_attention.default"], _sdpa)
