"""Peephole rewrites of an emitted rank program, after codegen and before it runs.

Cross-entropy reaches the runtime decomposed into primitive ops (planner.decompose), so that
the search can shard the class dimension (Megatron's vocab-parallel loss). Where a rank holds
whole rows of the logits x (classes not split), the pieces

    m  = amax(detach(x), [1], keepdim)        z  = x - m
    lse = log(sum(exp(z), [1]))               tl = squeeze(gather(z, 1, unsqueeze(t, 1)), [1])
    d  = lse - tl

compute, row by row, d_r = log sum_c exp(x_rc) - x_{r,t_r}, which is exactly
`F.cross_entropy(x, t, reduction="none")`: torch's fused kernel (log_softmax, then nll_loss)
makes one pass over the logits for what the pieces make five, in the forward and in the
backward (measured on GPT small-cpu's 0.25-CPU ranks: exp alone 7-8 ms of a 110-125 ms
forward). The rewrite matches only that exact chain, with no collective between the pieces
(x split by classes puts a Pmax and a partial-sum all-reduce there, so it never matches) and
no other reader of the intermediate values. d keeps its fx name, so the instruction it ends
is still stamped in traces (runtime.timing); the instructions whose pieces are erased are
stamped just before it (RankProgram.merged), so the fused call's time is charged to d's.
The valid-label mask and the sum stay as they are. Float64 parity is unchanged up to
rounding (the same mathematics in another order).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

aten = torch.ops.aten


def _is(node: Any, target: Any, *args: Any) -> bool:
    """`node` is a call of `target` whose trailing arguments after the first equal `args`."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target and \
        tuple(_plain(a) for a in node.args[1:]) == args


def _calls(node: Any, target: Any, nargs: int) -> bool:
    """`node` is a call of `target` with `nargs` positional arguments and no keywords."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target and \
        len(node.args) == nargs and not node.kwargs


def _plain(a: Any) -> Any:
    return tuple(a) if isinstance(a, (list, tuple)) else a


def _only_read_by(node: fx.Node, *readers: fx.Node) -> bool:
    return set(node.users) == set(readers)


def _cross_entropy_chain(d: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """(x, t, the pieces to erase) when `d` ends the decomposed per-row loss (module docstring)."""
    if not _calls(d, aten.sub.Tensor, 2):
        return None
    lse, tl = d.args
    if not (_is(lse, aten.log.default) and (_is(tl, aten.squeeze.dims, (1,)) or _is(tl, aten.squeeze.dim, 1))):
        return None
    total, picked = lse.args[0], tl.args[0]
    if not (_is(total, aten.sum.dim_IntList, (1,)) and _calls(picked, aten.gather.default, 3) and picked.args[1] == 1):
        return None
    exp, z, index = total.args[0], picked.args[0], picked.args[2]
    if not (_is(exp, aten.exp.default) and exp.args[0] is z and _calls(z, aten.sub.Tensor, 2) and
            _is(index, aten.unsqueeze.default, 1)):
        return None
    x, m = z.args
    if not (_is(m, aten.amax.default, (1,), True) and _is(m.args[0], aten.detach.default) and m.args[0].args[0] is x):
        return None
    chain = [lse, tl, total, picked, exp, z, m, m.args[0]]
    readers = {lse: [d], tl: [d], total: [lse], picked: [tl], exp: [total], z: [exp, picked], m: [z], m.args[0]: [m]}
    if not all(_only_read_by(n, *readers[n]) for n in chain):
        return None
    return x, index.args[0], chain + ([index] if _only_read_by(index, picked) else [])


def fuse_cross_entropy(graph: fx.Graph) -> dict[str, str]:
    """Rewrite every decomposed per-row cross-entropy of `graph` into one F.cross_entropy
    call (module docstring); returns {erased node: the node whose call now does its work}."""
    merged: dict[str, str] = {}
    for d in list(graph.nodes):
        found = _cross_entropy_chain(d)
        if found is None:
            continue
        x, target, chain = found
        d.target, d.args, d.kwargs = F.cross_entropy, (x, target), {"reduction": "none"}
        for piece in chain:  # readers first: each is unread once its readers are gone
            merged[piece.name] = d.name
            graph.erase_node(piece)
    return merged
