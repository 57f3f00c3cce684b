"""Reductions and index ops.

sum / mean / amax over dims `D`: an input sharded on d not in D stays sharded (on the shifted
dim without keepdim); sharded on d in D gives P for sum, P for mean (local sum divided by the
global count, `mean_global`) and Pmax for amax (`amax_sharded`: -inf over an empty shard). sum and mean are linear: P -> P.
var, prod, amin, any over `D`: shardable on the dims they keep only (a variance is not a sum
of per-shard variances; planner.decompose_norm writes batch norm's with means instead).

argmax/argmin, max/min.dim, sort, topk, cumsum along `dim`: shardable on every other dim
(cumsum is linear: P -> P). one_hot: shardable on every input dim. gather(x, dim, idx):
shardable on d != dim (x and idx); x sharded on `dim` with idx R gives P (`gather_sharded`: a
rank contributes the elements it owns, zeros elsewhere); gather is linear in x.
scatter / scatter_add / scatter_reduce(x, dim, idx, src) like gather: d != dim shards x, idx
and src together. index(x, [i0, .., ik-1]) with index tensors for the first k dims: the dims
after them shard (the index tensors R); linear in x.
"""

from __future__ import annotations

from hetsynth.instruction_set.graph import Node, TensorMeta
from hetsynth.instruction_set.layouts import P, PMAX, R, S
from hetsynth.instruction_set.rules.registry import Rule, arg, norm_dim, register


WHOLE = ("aten.sum.default", "aten.mean.default", "aten.amax.default", "aten.amin.default",
         "aten.prod.default", "aten.var.default")


def _reduced_dims(node: Node, ndim: int) -> set[int]:
    if node.target in WHOLE and len(node.args) < 2:
        return set(range(ndim))
    dims = arg(node, 1, "dim", None)
    if dims is None or dims == []:
        return set(range(ndim))
    dims = [dims] if isinstance(dims, int) else dims
    return {norm_dim(d, ndim) for d in dims}


def _reduction(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    shape = metas[0].shape
    reduced = _reduced_dims(node, len(shape))
    keepdim = bool(arg(node, 3 if node.target == "aten.var.dim" else 2, "keepdim", False))
    kind = node.target.split(".")[1]  # sum / mean / amax / var / prod / amin / any
    rules = [Rule((R,), R)]
    if kind in ("sum", "mean"):
        rules.append(Rule((P,), P))
    for d, size in enumerate(shape):
        if size <= 1:
            continue
        if d not in reduced:
            rules.append(Rule((S(d),), S(d if keepdim else d - sum(r < d for r in reduced))))
        elif kind not in ("sum", "mean", "amax"):
            continue
        elif kind == "amax":
            rules.append(Rule((S(d),), PMAX, "amax_sharded"))
        else:
            rules.append(Rule((S(d),), P, "mean_global" if kind == "mean" else ""))
    return rules


def _along_dim(default_dim: int | None, linear: bool, dim_index: int = 1, drops: bool = False):
    """Rules of an op along one dim; `drops`: the dim goes away unless keepdim (arg 2)."""
    def rules(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
        shape = metas[0].shape
        dim = arg(node, dim_index, "dim", default_dim)
        if dim is None:
            return [Rule((R,), R)]
        dim = norm_dim(dim, len(shape))
        keepdim = drops and not arg(node, 2, "keepdim", False)
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


def _scatter(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    x, idx = metas[:2]
    dim = norm_dim(arg(node, 1, "dim"), len(x.shape))
    rules = [Rule((R,) * len(metas), R)]
    for d, size in enumerate(x.shape):
        if d != dim and size > 1 and all(m.shape[d] == size for m in metas[1:]):
            rules.append(Rule((S(d),) * len(metas), S(d)))
    return rules


def _index(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    """index(x, indices) with index tensors for a contiguous run of dims [a, b): the dims
    before the run keep their place, those after it move by (index dims - (b - a))."""
    indices = arg(node, 1, "indices")
    given = [i for i, t in enumerate(indices) if t is not None]
    rules = [Rule((R,) * len(metas), R)]
    if not given or given != list(range(given[0], given[-1] + 1)):
        return rules
    x, (a, b) = metas[0], (given[0], given[-1] + 1)
    rest = (R,) * (len(metas) - 1)
    shift = len(node.outputs[0].shape) - len(x.shape)
    rules.append(Rule((P,) + rest, P))
    for d, size in enumerate(x.shape):
        if size > 1 and not a <= d < b:
            rules.append(Rule((S(d),) + rest, S(d + (shift if d >= b else 0))))
    return rules


register(["aten.sum.default", "aten.sum.dim_IntList", "aten.mean.default", "aten.mean.dim",
          "aten.amax.default", "aten.amin.default", "aten.var.correction", "aten.var.dim",
          "aten.prod.default", "aten.prod.dim_int", "aten.any.dim", "aten.any.dims"], _reduction)
register(["aten.argmax.default", "aten.argmin.default", "aten.max.dim", "aten.min.dim"],
         _along_dim(None, linear=False, drops=True))
register(["aten.sort.default"], _along_dim(-1, linear=False))
register(["aten.topk.default"], _along_dim(-1, linear=False, dim_index=2))
register(["aten.cumsum.default"], _along_dim(None, linear=True))
register(["aten.one_hot.default"], _one_hot)
register(["aten.gather.default"], _gather)
register(["aten.scatter.src", "aten.scatter.value", "aten.scatter_add.default",
          "aten.scatter_reduce.two"], _scatter)
register(["aten.index.Tensor"], _index)
