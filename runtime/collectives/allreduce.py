"""All-reduce P -> R (sum) and Pmax -> R (max) over a group.

Variants:
  ring          the backend's all_reduce on the group
  hierarchical  (all ranks of a two-level mesh) reduce-scatter inside each node, all-reduce of
                each rank's 1/t across nodes, all-gather inside the node (BlueConnect, Cho et
                al., SysML 2019); `inner` and `outer` are the node and cross-node spans

Backward of the sum all-reduce is itself (the gradient of an R tensor is Partial; every rank
needs the total). all_reduce_max is only applied to tensors without gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from runtime.collectives.span import Span


def reduce_ring(x: torch.Tensor, span: Span) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=span.group)
    return out


def reduce_hierarchical(x: torch.Tensor, inner: Span, outer: Span) -> torch.Tensor:
    t = inner.size
    flat = x.contiguous().reshape(-1)
    chunk = -(-flat.numel() // t)
    padded = torch.cat([flat, flat.new_zeros(chunk * t - flat.numel())])
    part = flat.new_empty(chunk)
    dist.reduce_scatter_single(part, padded, op=dist.ReduceOp.SUM, group=inner.group)
    dist.all_reduce(part, op=dist.ReduceOp.SUM, group=outer.group)
    whole = flat.new_empty(chunk * t)
    dist.all_gather_single(whole, part, group=inner.group)
    return whole[:flat.numel()].view_as(x)


def reduce_sum(x: torch.Tensor, span: Span, levels: tuple[Span, Span] | None = None) -> torch.Tensor:
    """The sum over the group: hierarchical when `levels` (node span, cross-node span) are given."""
    return reduce_hierarchical(x, *levels) if levels else reduce_ring(x, span)


class AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, span: Span, levels: tuple[Span, Span] | None) -> torch.Tensor:
        ctx.span, ctx.levels = span, levels
        return reduce_sum(x, span, levels)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return reduce_sum(grad, ctx.span, ctx.levels), None, None


def all_reduce(x: torch.Tensor, span: Span, levels: tuple[Span, Span] | None = None) -> torch.Tensor:
    """Sum over the group; `levels` = (node span, cross-node span) for the hierarchical variant."""
    return AllReduce.apply(x, span, levels)


def all_reduce_max(x: torch.Tensor, span: Span) -> torch.Tensor:
    out = x.detach().contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=span.group)
    return out
