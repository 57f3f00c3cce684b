"""View-like ops: they move elements between dims but compute nothing.

A reshape pairs runs of input dims with runs of output dims of equal product ("groups"); a
shard on the outermost non-unit dim of an input group is a contiguous block of the group's
flattened elements, which is a shard of the outermost non-unit dim of the output group. So
`[B, S, H] S0 -> [B*S, H] S0` (lengths scale by S) and `[B, S, H] S2 -> [B, S, nh, hd] S2`
(lengths divide by hd), but `[B, S, H] S1 -> [B*S, H]` has no rule. The plan derives the
scaled shard lengths once (instruction_set.shards). Views are linear, so P passes through.
"""

from __future__ import annotations

from hetsynth.instruction_set.graph import Node, TensorMeta
from hetsynth.instruction_set.layouts import P, R, S
from hetsynth.instruction_set.rules.registry import Rule, arg, norm_dim, register

Shape = tuple[int, ...]


def view_groups(a: Shape, b: Shape) -> list[tuple[list[int], list[int]]]:
    """Consecutive dim runs of `a` and `b` with equal products, in order."""
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        gi, gj, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                gi.append(i)
                pa *= a[i]
                i += 1
            else:
                gj.append(j)
                pb *= b[j]
                j += 1
        groups.append((gi, gj))
    return groups


def _outer(dims: list[int], shape: Shape) -> int | None:
    return next((d for d in dims if shape[d] > 1), None)


def _base(n: int) -> list[Rule]:
    return [Rule((R,) * n, R), Rule((P,) + (R,) * (n - 1), P)]


def _reshape(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    a, b = metas[0].shape, node.outputs[0].shape
    rules = _base(len(metas))
    for gi, gj in view_groups(a, b):
        di, dj = _outer(gi, a), _outer(gj, b)
        if di is not None and dj is not None:
            rules.append(Rule((S(di),), S(dj)))
    return rules


def _permuted(node: Node, metas: tuple[TensorMeta, ...], perm: list[int]) -> list[Rule]:
    """Output dim j is input dim perm[j]."""
    rules = _base(1)
    shape = metas[0].shape
    rules += [Rule((S(src),), S(j)) for j, src in enumerate(perm) if shape[src] > 1]
    return rules


def _transpose(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    nd = len(metas[0].shape)
    d0, d1 = norm_dim(arg(node, 1, "dim0", 0), nd), norm_dim(arg(node, 2, "dim1", 1), nd)
    perm = list(range(nd))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permuted(node, metas, perm)


def _permute(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    nd = len(metas[0].shape)
    return _permuted(node, metas, [norm_dim(d, nd) for d in arg(node, 1, "dims")])


def _t(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    return _permuted(node, metas, [1, 0] if len(metas[0].shape) == 2 else [0])


def _keep_dims_except(node: Node, metas: tuple[TensorMeta, ...], dropped: set[int],
                      shift_at: int | None = None) -> list[Rule]:
    """Dims not in `dropped` keep their order; with shift_at, output dims >= it move up by 1."""
    rules = _base(len(metas))
    shape = metas[0].shape
    out_dim = 0
    for d in range(len(shape)):
        if d in dropped:
            continue
        j = out_dim + (1 if shift_at is not None and out_dim >= shift_at else 0)
        if shape[d] > 1:
            rules.append(Rule((S(d),) + (R,) * (len(metas) - 1), S(j)))
        out_dim += 1
    return rules


def _view_as_complex(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    """(..., 2) real -> (...) complex: the pairs' dim is consumed; the others keep their place."""
    return _keep_dims_except(node, metas, {len(metas[0].shape) - 1})


def _view_as_real(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    """(...) complex -> (..., 2) real: every input dim keeps its place, the pairs' dim is new and last."""
    return _keep_dims_except(node, metas, set())


def _unsqueeze(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    d = norm_dim(arg(node, 1, "dim"), len(metas[0].shape) + 1)
    return _keep_dims_except(node, metas, set(), shift_at=d)


def _squeeze(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    shape = metas[0].shape
    dims = arg(node, 1, "dim", None)
    dims = range(len(shape)) if dims is None else ([dims] if isinstance(dims, int) else dims)
    return _keep_dims_except(node, metas, {norm_dim(d, len(shape)) for d in dims if shape[d] == 1})


def _select(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    return _keep_dims_except(node, metas, {norm_dim(arg(node, 1, "dim"), len(metas[0].shape))})


def _other_dims(node: Node, metas: tuple[TensorMeta, ...], dims: set[int]) -> list[Rule]:
    """Dims not in `dims` may be sharded (the op acts along `dims` only); extra inputs R."""
    rules = _base(len(metas))
    for d, size in enumerate(metas[0].shape):
        if d not in dims and size > 1 and node.outputs[0].shape[d] == size:
            rules.append(Rule((S(d),) + (R,) * (len(metas) - 1), S(d)))
    return rules


def _slice(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    shape = metas[0].shape
    dim = norm_dim(arg(node, 1, "dim", 0), len(shape))
    full = node.outputs[0].shape[dim] == shape[dim]
    return _other_dims(node, metas, set() if full else {dim})


def _split(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    return _other_dims_multi(metas[0].shape, norm_dim(arg(node, 2, "dim", 0), len(metas[0].shape)))


def _other_dims_multi(shape: Shape, dim: int) -> list[Rule]:
    rules = _base(1)
    rules += [Rule((S(d),), S(d)) for d, size in enumerate(shape) if d != dim and size > 1]
    return rules


def _getitem(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    rules = _base(1)
    rules += [Rule((S(d),), S(d)) for d, size in enumerate(node.outputs[0].shape) if size > 1]
    return rules


def _cat(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    out = node.outputs[0].shape
    dim = norm_dim(arg(node, 1, "dim", 0), len(out))
    n = len(metas)
    rules = [Rule((R,) * n, R), Rule((P,) * n, P)]
    rules += [Rule((S(d),) * n, S(d)) for d, size in enumerate(out) if d != dim and size > 1]
    return rules


def _stack(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    shape = metas[0].shape
    dim = norm_dim(arg(node, 1, "dim", 0), len(shape) + 1)
    n = len(metas)
    rules = [Rule((R,) * n, R), Rule((P,) * n, P)]
    rules += [Rule((S(d),) * n, S(d + (d >= dim))) for d, size in enumerate(shape) if size > 1]
    return rules


def _expand(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    """Aligned dims keep their shard; a broadcast dim may come out sharded from an R input."""
    a, b = metas[0].shape, node.outputs[0].shape
    rules = _base(1)
    for d, size in enumerate(b):
        k = d - (len(b) - len(a))
        if size > 1 and k >= 0 and a[k] == size:
            rules.append(Rule((S(k),), S(d)))
        elif size > 1:
            rules.append(Rule((R,), S(d)))
    return rules


def _pad(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    nd = len(metas[0].shape)
    padded = {nd - 1 - i // 2 for i in range(len(arg(node, 1, "pad")))}
    rules = _other_dims(node, metas, padded)
    return [r for r in rules if r.output != P]  # padding with a value is not linear


def _index_select(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    return _other_dims(node, metas, {norm_dim(arg(node, 1, "dim"), len(metas[0].shape))})


def _repeat(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    """x.repeat(r): output dim j tiles input dim j - lead r[j] times; untiled dims shard."""
    shape, reps = metas[0].shape, arg(node, 1, "repeats")
    lead = len(reps) - len(shape)
    rules = _base(1)
    rules += [Rule((S(d),), S(d + lead)) for d, size in enumerate(shape) if size > 1 and reps[d + lead] == 1]
    return rules


def _scatter_into(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    """slice_scatter / select_scatter(x, src, dim, ...): other dims shard x and src alike."""
    shape = metas[0].shape
    dim = norm_dim(arg(node, 2, "dim", 0), len(shape))
    selected = node.target == "aten.select_scatter.default"
    rules = [Rule((R, R), R), Rule((P, P), P)]
    for d, size in enumerate(shape):
        if d != dim and size > 1:
            rules.append(Rule((S(d), S(d - (selected and d > dim))), S(d)))
    return rules


def _flip(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    nd = len(metas[0].shape)
    return _other_dims(node, metas, {norm_dim(d, nd) for d in arg(node, 1, "dims")})


register(["aten.view.default", "aten.reshape.default", "aten._unsafe_view.default"], _reshape,
         shape_arg=1)
register(["aten.flatten.using_ints"], _reshape)
register(["aten.transpose.int"], _transpose)
register(["aten.permute.default"], _permute)
register(["aten.t.default"], _t)
register(["aten.unsqueeze.default"], _unsqueeze)
register(["aten.view_as_complex.default"], _view_as_complex)
register(["aten.view_as_real.default"], _view_as_real)
register(["aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default"], _squeeze)
register(["aten.select.int"], _select)
register(["aten.slice.Tensor"], _slice)
register(["aten.split.Tensor", "aten.split_with_sizes.default"], _split)
register(["getitem"], _getitem)
register(["aten.cat.default"], _cat)
register(["aten.stack.default"], _stack)
register(["aten.expand.default"], _expand, shape_arg=1)
register(["aten.pad.default", "aten.constant_pad_nd.default"], _pad)
register(["aten.index_select.default"], _index_select)
register(["aten.flip.default"], _flip)
register(["aten.repeat.default"], _repeat)
register(["aten.slice_scatter.default", "aten.select_scatter.default"], _scatter_into)
