"""All-reduce P -> R (sum) and Pmax -> R (max) over a group.

Variants:
  ring          the backend's all_reduce on the group
  hierarchical  (all ranks of a two-level mesh) reduce-scatter inside each node (an all-to-all of
                the t parts, then a sum: scatter_parts), all-reduce of each rank's 1/t across
                nodes, all-gather inside the node (BlueConnect, Cho et al., SysML 2019);
                `inner` and `outer` are the node and cross-node spans

Backward of the sum all-reduce is itself (the gradient of an R tensor is Partial; every rank
needs the total). all_reduce_max is only applied to tensors without gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hetsynth.runtime.collectives.span import Span


def reduce_ring(x: torch.Tensor, span: Span) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=span.group)
    return out


def scatter_parts(flat: torch.Tensor, group: Any, *, async_op: bool = False) -> tuple[Any, torch.Tensor]:
    """The exchange of the in-node reduce-scatter: the flat tensor, zero-padded to t equal
    parts, is all-to-all'ed, so member j receives every member's part j, as rows of a
    [t, part] tensor whose sum over rows is its part of the reduced tensor; (work when
    `async_op`, received). An all-to-all and not the backend's reduce_scatter: gloo's
    reduce_scatter work gives no future and reports completion only once waited, so an
    asynchronous one could not start the next stage of a gradient bucket before the step
    waits for it (runtime.grad_sync), and its fit inside a node of local-emulated is 4.6 ms +
    D / 0.84 Gbit/s against the all-to-all's 1.4 ms + D / 0.90 (the same bytes move)."""
    t = dist.get_world_size(group)
    chunk = -(-flat.numel() // t)
    padded = torch.cat([flat, flat.new_zeros(chunk * t - flat.numel())])
    received = flat.new_empty(chunk * t)
    work = dist.all_to_all_single(received, padded, group=group, async_op=async_op)
    return work, received.view(t, chunk)


def reduce_hierarchical(x: torch.Tensor, inner: Span, outer: Span) -> torch.Tensor:
    flat = x.contiguous().reshape(-1)
    _, parts = scatter_parts(flat, inner.group)
    part = parts.sum(0)
    dist.all_reduce(part, op=dist.ReduceOp.SUM, group=outer.group)
    whole = flat.new_empty(part.numel() * inner.size)
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
