"""Reductions and index ops.

sum / mean / amax over dims `D`: an input sharded on d not in D stays sharded (on the shifted
dim without keepdim); sharded on d in D gives P for sum, P for mean (local sum divided by the
global count, `mean_global`) and Pmax for amax (`amax_sharded`: -inf over an empty shard). sum and mean are linear: P -> P.

argmax, topk, cumsum along `dim`: shardable on every other dim (cumsum is linear: P -> P).
one_hot: shardable on every input dim. gather(x, dim, idx): shardable on d != dim (x and idx);
x sharded on `dim` with idx R gives P (`gather_sharded`: a rank contributes the elements it
owns, zeros elsewhere); gather is linear in x.
"""

from __future__ import annotations

from instruction_set.graph import Node, TensorMeta
from instruction_set.layouts import P, PMAX, R, S
from instruction_set.rules import Rule, arg, norm_dim, register


def _reduced_dims(node: Node, ndim: int) -> set[int]:
    if node.target in ("aten.sum.default", "aten.mean.default", "aten.amax.default") and len(node.args) < 2:
        return set(range(ndim))
    dims = arg(node, 1, "dim", None)
    if dims is None or dims == []:
        return set(range(ndim))
    dims = [dims] if isinstance(dims, int) else dims
    return {norm_dim(d, ndim) for d in dims}


def _reduction(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    shape = metas[0].shape
    reduced = _reduced_dims(node, len(shape))
    keepdim = bool(arg(node, 2, "keepdim", False))
    kind = node.target.split(".")[1]  # sum / mean / amax
    rules = [Rule((R,), R)]
    if kind != "amax":
        rules.append(Rule((P,), P))
    for d, size in enumerate(shape):
        if size <= 1:
            continue
        if d not in reduced:
            rules.append(Rule((S(d),), S(d if keepdim else d - sum(r < d for r in reduced))))
        elif kind == "amax":
            rules.append(Rule((S(d),), PMAX, "amax_sharded"))
        else:
            rules.append(Rule((S(d),), P, "mean_global" if kind == "mean" else ""))
    return rules


def _along_dim(default_dim: int | None, linear: bool, dim_index: int = 1):
    def rules(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
        shape = metas[0].shape
        dim = arg(node, dim_index, "dim", default_dim)
        if dim is None:
            return [Rule((R,), R)]
        dim = norm_dim(dim, len(shape))
        keepdim = node.target == "aten.argmax.default" and not arg(node, 2, "keepdim", False)
        out = [Rule((R,), R)] + ([Rule((P,), P)] if linear else [])
        for d, size in enumerate(shape):
            if d != dim and size > 1:
                out.append(Rule((S(d),), S(d - (keepdim and d > dim))))
        return out

    return rules


def _one_hot(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    return [Rule((R,), R)] + [Rule((S(d),), S(d)) for d, s in enumerate(metas[0].shape) if s > 1]


def _gather(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    x, idx = metas[:2]
    dim = norm_dim(arg(node, 1, "dim"), len(x.shape))
    rules = [Rule((R, R), R), Rule((P, R), P)]
    for d, size in enumerate(idx.shape):
        if d != dim and size > 1 and x.shape[d] == size:
            rules.append(Rule((S(d), S(d)), S(d)))
    if x.shape[dim] > 1:
        rules.append(Rule((S(dim), R), P, "gather_sharded"))
    return rules


register(["aten.sum.default", "aten.sum.dim_IntList", "aten.mean.default", "aten.mean.dim",
          "aten.amax.default"], _reduction)
register(["aten.argmax.default"], _along_dim(None, linear=False))
register(["aten.topk.default"], _along_dim(-1, linear=False, dim_index=2))
register(["aten.cumsum.default"], _along_dim(None, linear=True))
register(["aten.one_hot.default"], _one_hot)
register(["aten.gather.default"], _gather)
