"""All-to-all S(a) -> S(b) over a group, with uneven splits (all_to_all_single).

A rank holds its slice of dim a (whole along b); it cuts that along b into one piece per
member (the members' lengths along b), sends piece j to member j, and concatenates the
pieces it receives along a in member order. Works on gloo (uneven all_to_all_single is
supported) and NCCL. Backward is the reverse all-to-all S(b) -> S(a).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hetsynth.runtime.collectives.span import Span


def exchange_dims(x: torch.Tensor, src: Span, dst: Span) -> torch.Tensor:
    """x is split on src.dim (my length src.my_length); return it split on dst.dim."""
    pieces = [p.contiguous() for p in x.split(list(dst.lengths), dim=dst.dim)]
    send = torch.cat([p.reshape(-1) for p in pieces]) if pieces else x.new_zeros(0)
    shapes = []
    for j in range(src.size):
        shape = list(x.shape)
        shape[src.dim], shape[dst.dim] = src.lengths[j], dst.my_length
        shapes.append(shape)
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    recv = x.new_empty(sum(sizes))
    dist.all_to_all_single(recv, send, output_split_sizes=sizes,
                           input_split_sizes=[p.numel() for p in pieces], group=src.group)
    parts = [chunk.view(shape) for chunk, shape in zip(recv.split(sizes), shapes)]
    return torch.cat(parts, dim=src.dim)


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, src: Span, dst: Span) -> torch.Tensor:
        ctx.src, ctx.dst = src, dst
        return exchange_dims(x, src, dst)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return exchange_dims(grad.contiguous(), ctx.dst, ctx.src), None, None


def all_to_all(x: torch.Tensor, src: Span, dst: Span) -> torch.Tensor:
    return AllToAll.apply(x, src, dst)


class RowExchange:
    """Rows of dim 0 between the members of a group, in counts known only at run time
    (instruction_set.experts_op.Exchange: routed pairs to their experts' ranks)."""

    def __init__(self, group: Any, size: int, device: torch.device) -> None:
        self.group, self.size, self.device = group, size, device  # the counts travel where the group's backend does

    def counts(self, send: list[int]) -> list[int]:
        received = torch.zeros(self.size, dtype=torch.int64, device=self.device)
        dist.all_to_all_single(received, torch.tensor(send, dtype=torch.int64, device=self.device), group=self.group)
        return received.tolist()

    def rows(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        return RowsAllToAll.apply(rows, send, recv, self.group)


def _rows_all_to_all(rows: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class RowsAllToAll(torch.autograd.Function):
    """`send[j]` rows to member j, `recv[j]` from it; the backward returns the gradients of the
    received rows to their senders (the same exchange with the counts swapped)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _rows_all_to_all(rows, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _rows_all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None
