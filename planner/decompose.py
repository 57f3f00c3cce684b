"""Graph rewrites applied after export, before the planner sees the graph.

Cross-entropy is decomposed into primitive ops so that the sharding rules of those
primitives let the search find batch-parallel *and* vocab-parallel losses on its own
(Megatron's vocab-parallel cross-entropy is exactly this program with the class dim sharded):

    m     = amax(detach(x), 1, keepdim)          # max per row, no gradient (Pmax if x is S1)
    z     = x - m
    lse   = log(sum(exp(z), 1))                  # sum over classes (P if x is S1)
    valid = target != ignore_index
    tl    = squeeze(gather(z, 1, unsqueeze(target * valid, 1)), 1)
    total = sum((lse - tl) * valid)
    count = sum(float(valid))                    # in x's dtype, as nll_loss's total_weight
    loss  = total / count                        # mean reduction; total for sum reduction

The count is summed in x's floating-point dtype (exact for fewer than 2^24 labels in float32,
2^53 in float64; torch's nll_loss divides by the same float): a floating-point sum may be a
partial sum (instruction_set.rules.registry keeps partials for floats only), so with the
labels split by rows the count costs one scalar all-reduce instead of an all-gather of the
label mask, and with the labels loaded whole (R; planner.transitions lets integer inputs be
loaded whole under any restriction) it costs no communication at all.

This equals `F.cross_entropy(x, target, ignore_index=...)` for 2-d `x` without class weights
or label smoothing; other forms are left alone (and reported unsupported).
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten

MEAN, SUM = 1, 2


def _ce_args(node: fx.Node) -> tuple[fx.Node, fx.Node, int, int] | None:
    names = ["self", "target", "weight", "reduction", "ignore_index", "label_smoothing"]
    values = dict(zip(names, node.args)) | dict(node.kwargs)
    x, target = values["self"], values["target"]
    ok = (
        values.get("weight") is None
        and values.get("reduction", MEAN) in (MEAN, SUM)
        and values.get("label_smoothing", 0.0) == 0.0
        and len(x.meta["val"].shape) == 2
    )
    return (x, target, values.get("reduction", MEAN), values.get("ignore_index", -100)) if ok else None


def _emit_cross_entropy(g: fx.Graph, x: fx.Node, target: fx.Node, reduction: int, ignore: int) -> fx.Node:
    m = g.call_function(aten.amax.default, (g.call_function(aten.detach.default, (x,)), [1], True))
    z = g.call_function(aten.sub.Tensor, (x, m))
    lse = g.call_function(aten.log.default, (
        g.call_function(aten.sum.dim_IntList, (g.call_function(aten.exp.default, (z,)), [1])),))
    valid = g.call_function(aten.ne.Scalar, (target, ignore))
    safe = g.call_function(aten.mul.Tensor, (target, valid))
    picked = g.call_function(aten.gather.default, (z, 1, g.call_function(aten.unsqueeze.default, (safe, 1))))
    tl = g.call_function(aten.squeeze.dim, (picked, 1))
    per = g.call_function(aten.mul.Tensor, (g.call_function(aten.sub.Tensor, (lse, tl)), valid))
    total = g.call_function(aten.sum.default, (per,))
    if reduction == SUM:
        return total
    dtype = x.meta["val"].dtype
    count = g.call_function(aten.sum.default, (g.call_function(aten._to_copy.default, (valid,), {"dtype": dtype}),))
    return g.call_function(aten.div.Tensor, (total, count))


def decompose_cross_entropy(gm: fx.GraphModule) -> int:
    """Replace every decomposable aten.cross_entropy_loss node; returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.target is not aten.cross_entropy_loss.default:
            continue
        parsed = _ce_args(node)
        if parsed is None:
            continue
        with gm.graph.inserting_before(node):
            loss = _emit_cross_entropy(gm.graph, *parsed)
        for new in _nodes_between(loss, node):
            new.meta.update({k: node.meta[k] for k in ("custom", "nn_module_stack", "stack_trace") if k in node.meta})
        node.replace_all_uses_with(loss)
        gm.graph.erase_node(node)
        count += 1
    return count


def _nodes_between(last: fx.Node, anchor: fx.Node) -> list[fx.Node]:
    """The nodes inserted just before `anchor`, up to and including `last`."""
    out, cur = [], last
    while cur is not anchor and cur.op == "call_function" and "val" not in cur.meta:
        out.append(cur)
        cur = cur.prev
    return out


ASSERTIONS = (aten._assert_tensor_metadata.default, aten._assert_scalar.default,
              aten._assert_async.msg, aten._assert_async.default, aten.sym_constrain_range_for_size.default)


def strip_noops(gm: fx.GraphModule, *, dead_code: bool = False) -> None:
    """Remove runtime assertion nodes that compute nothing (they check values, such as
    one_hot's index range, that the single-device run checks too); with `dead_code`, also
    the pure nodes no longer used (the graph must be functional)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in ASSERTIONS and not node.users:
            gm.graph.erase_node(node)
    if dead_code:
        gm.graph.eliminate_dead_code()
