"""Batch norm and group norm as primitive ops, so that their statistics shard like sums.

Batch norm over x [N, C, *S] (training, reduced dims D = {0} + S, n = N * prod(S)):

    mean  = mean(x, D, keepdim)                 # P when x is batch-split: all-reduced
    xc    = x - mean
    var   = mean(xc * xc, D, keepdim)           # biased variance, all-reduced likewise
    rstd  = rsqrt(var + eps)
    y     = xc * rstd * w[C, 1..] + b[C, 1..]
    running_mean' = running_mean * (1 - m) + squeeze(detach(mean)) * m
    running_var'  = running_var * (1 - m) + squeeze(detach(var)) * m * n / (n - 1)

With x split on the batch dim the two means are Partial sums divided by the global count
(rule `mean_global`); making them replicated is an all-reduce over the batch group, chosen and
costed by the planner like any collective. That is SyncBatchNorm's reduction (per-channel
sum, then the sum of squared deviations, over the group), so the normalisation and the
running statistics equal single-device training. Split on the channel dim, nothing is
reduced across devices. In evaluation form (`_native_batch_norm_legit_no_training`) the
running statistics replace mean and var and nothing is updated.

Group norm over x [N, C, *S] with G groups: x viewed as [N, G, C/G * prod(S)], mean and
biased variance over the last dim, normalised, viewed back, then the per-channel affine. Its
statistics are per sample, so a batch split needs no communication.

The fused ops' other outputs (saved mean and inverse std) map to the squeezed statistics.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Sequence

import torch
from torch import fx

aten = torch.ops.aten

BATCH_NORM = (aten._native_batch_norm_legit_functional.default, aten._native_batch_norm_legit.no_stats,
              aten._native_batch_norm_legit_no_training.default)
GROUP_NORM = (aten.native_group_norm.default,)


class _Emit:
    """Emits calls before an anchor node."""

    def __init__(self, g: fx.Graph) -> None:
        self.g = g

    def __call__(self, op: Any, *args: Any) -> fx.Node:
        return self.g.call_function(op, args)


def _affine(e: _Emit, y: fx.Node, weight: Any, bias: Any, channels: int, ndim: int) -> fx.Node:
    shape = [channels] + [1] * (ndim - 2)
    if weight is not None:
        y = e(aten.mul.Tensor, y, e(aten.view.default, weight, shape))
    if bias is not None:
        y = e(aten.add.Tensor, y, e(aten.view.default, bias, shape))
    return y


def _normalise(e: _Emit, x: fx.Node, dims: list[int], eps: float) -> tuple[fx.Node, ...]:
    """(x - mean) * rstd, mean, biased variance and rstd over `dims` (kept)."""
    mean = e(aten.mean.dim, x, dims, True)
    xc = e(aten.sub.Tensor, x, mean)
    var = e(aten.mean.dim, e(aten.mul.Tensor, xc, xc), dims, True)
    rstd = e(aten.rsqrt.default, e(aten.add.Tensor, var, eps))
    return e(aten.mul.Tensor, xc, rstd), mean, var, rstd


def _running(e: _Emit, running: fx.Node, stat: fx.Node, dims: list[int], momentum: float, scale: float) -> fx.Node:
    new = e(aten.mul.Tensor, e(aten.squeeze.dims, e(aten.detach.default, stat), dims), momentum * scale)
    return e(aten.add.Tensor, e(aten.mul.Tensor, running, 1.0 - momentum), new)


def _batch_norm(e: _Emit, node: fx.Node) -> list[Any]:
    """[y, save_mean, save_rstd, (running_mean', running_var')] of a batch-norm node."""
    x = node.args[0]
    shape = x.meta["val"].shape
    dims = [0] + list(range(2, len(shape)))
    channels, count = shape[1], math.prod(shape) // max(shape[1], 1)
    weight, bias = node.args[1], node.args[2]
    if node.target is aten._native_batch_norm_legit_no_training.default:
        rm, rv, momentum, eps = node.args[3:7]
        view = [channels] + [1] * (len(shape) - 2)
        mean, var = e(aten.view.default, rm, view), e(aten.view.default, rv, view)
        rstd = e(aten.rsqrt.default, e(aten.add.Tensor, var, eps))
        y = e(aten.mul.Tensor, e(aten.sub.Tensor, x, mean), rstd)
        return [_affine(e, y, weight, bias, channels, len(shape)), None, None]
    functional = node.target is aten._native_batch_norm_legit_functional.default
    momentum, eps = node.args[-2:]
    y, mean, var, rstd = _normalise(e, x, dims, eps)
    out = [_affine(e, y, weight, bias, channels, len(shape)),
           e(aten.squeeze.dims, mean, dims), e(aten.squeeze.dims, rstd, dims)]
    if functional:
        bessel = count / (count - 1) if count > 1 else float("inf")
        out += [_running(e, node.args[3], mean, dims, momentum, 1.0),
                _running(e, node.args[4], var, dims, momentum, bessel)]
    return out


def _group_norm(e: _Emit, node: fx.Node) -> list[Any]:
    x, weight, bias, n, c, hxw, groups, eps = node.args
    shape = list(x.meta["val"].shape)
    grouped = e(aten.view.default, x, [n, groups, (c // groups) * hxw])
    y, mean, _, rstd = _normalise(e, grouped, [2], eps)
    y = _affine(e, e(aten.view.default, y, shape), weight, bias, c, len(shape))
    return [y, e(aten.view.default, mean, [n, groups]), e(aten.view.default, rstd, [n, groups])]


def _replace(gm: fx.GraphModule, node: fx.Node, outputs: Sequence[Any]) -> None:
    for user in list(node.users):
        if user.target is not operator.getitem:
            raise ValueError(f"{node.name}: unexpected use by {user.name}")
        value = outputs[user.args[1]]
        if value is None and user.users:
            raise ValueError(f"{node.name}: output {user.args[1]} is read but not decomposed")
        if value is not None:
            user.replace_all_uses_with(value)
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)


def decompose_norms(gm: fx.GraphModule) -> int:
    """Replace every batch-norm and group-norm node by primitive ops; returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in BATCH_NORM + GROUP_NORM:
            continue
        with gm.graph.inserting_before(node):
            emit = _Emit(gm.graph)
            first = node.prev
            outputs = _batch_norm(emit, node) if node.target in BATCH_NORM else _group_norm(emit, node)
        new = first.next
        while new is not node:
            for key in ("custom", "nn_module_stack", "stack_trace"):
                if key in node.meta:
                    new.meta[key] = node.meta[key]
            new = new.next
        _replace(gm, node, outputs)
        count += 1
    return count
