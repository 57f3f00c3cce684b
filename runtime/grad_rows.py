"""ZeRO-2's gradient buckets: where a reduce-scatter bucket's gradients lie in its copy-in
buffer, and the asynchronous collectives that reduce-scatter it onto every rank's rows.

runtime.grad_sync runs these buckets like its all-reduce buckets (one lane of process groups
per kind, variant, axis and stage); this module holds what is particular to them:

    copy-in   rank-major segments [rank 0: p1 rows_0 | p2 rows_0 | ...][rank 1: ...], rank r's
              segment at starts[r] (padded: r times the largest segment; grouped: packed)
    padded    one reduce_scatter_single of the padded segments
    grouped   one reduce of rank r's segment to rank r, for every rank with rows (no padding)

(ring, a chain of point-to-point steps, is not issued asynchronously: SCATTER_VARIANTS.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from hetsynth.instruction_set.training_state import SCATTER_VARIANTS
from hetsynth.runtime.collectives import Span


@dataclass(frozen=True)
class RowsLayout:
    """Where a reduce-scatter bucket's gradients of one dtype lie in its copy-in buffer
    (module docstring): rank r's segment starts at starts[r] and holds, per parameter k in
    order, its rows[k][r] rows."""

    shapes: tuple[torch.Size, ...]
    rows: tuple[tuple[int, ...], ...]    # per parameter, per rank
    span: Span                           # the group's members and this rank's index
    padded: bool

    def numel(self, k: int, rank: int) -> int:
        return self.rows[k][rank] * math.prod(self.shapes[k][1:])

    @property
    def lengths(self) -> list[int]:
        return [sum(self.numel(k, r) for k in range(len(self.shapes))) for r in range(self.span.size)]

    @property
    def starts(self) -> list[int]:
        lengths = self.lengths
        return [r * max(lengths) for r in range(len(lengths))] if self.padded else \
            [sum(lengths[:r]) for r in range(len(lengths))]

    @property
    def size(self) -> int:
        return self.starts[-1] + (max(self.lengths) if self.padded else self.lengths[-1])

    def place(self, buffer: torch.Tensor, k: int, grad: torch.Tensor) -> None:
        """Copy parameter k's whole gradient into every rank's segment."""
        starts, offset = self.starts, 0
        for r in range(self.span.size):
            n = self.numel(k, r)
            if n:
                at = starts[r] + sum(self.numel(j, r) for j in range(k))
                buffer[at:at + n].copy_(grad.narrow(0, offset, self.rows[k][r]).reshape(-1))
            offset += self.rows[k][r]

    def views(self, mine: torch.Tensor) -> list[torch.Tensor]:
        """This rank's rows of every parameter, views of its reduced segment."""
        out, at, me = [], 0, self.span.index
        for k, shape in enumerate(self.shapes):
            n = self.numel(k, me)
            out.append(mine[at:at + n].view(self.rows[k][me], *shape[1:]))
            at += n
        return out


def _rows_padded(flat: torch.Tensor, layout: RowsLayout, group: Any) -> tuple[Any, Any]:
    """Every rank's segment padded to the largest: one reduce_scatter_single."""
    out = flat.new_empty(max(layout.lengths))
    work = dist.reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=group, async_op=True) \
        if out.numel() else []
    return work, (layout, out)


def _rows_grouped(flat: torch.Tensor, layout: RowsLayout, group: Any) -> tuple[Any, Any]:
    """One reduce of rank r's segment to rank r, for every rank with rows (no padding)."""
    span, starts, lengths = layout.span, layout.starts, layout.lengths
    works = [dist.reduce(flat[s:s + n], dst=m, op=dist.ReduceOp.SUM, group=group, async_op=True)
             for s, n, m in zip(starts, lengths, span.members) if n > 0]
    return works, (layout, flat[starts[span.index]:])


Stage = tuple[str | None, Callable[[torch.Tensor, Any, Any], tuple[Any, Any]]]
SCATTER_STAGES: dict[str, tuple[Stage, ...]] = {"padded": ((None, _rows_padded),), "grouped": ((None, _rows_grouped),)}
assert set(SCATTER_STAGES) == set(SCATTER_VARIANTS)


def row_layouts(params: list[nn.Parameter], rows: list[tuple[int, ...]], span: Span, variant: str) -> list[RowsLayout]:
    out = []
    for dtype in dict.fromkeys(p.dtype for p in params):
        members = [k for k, p in enumerate(params) if p.dtype == dtype]
        out.append(RowsLayout(tuple(params[k].shape for k in members), tuple(rows[k] for k in members), span,
                              variant == "padded"))
    return out


__all__ = ["SCATTER_STAGES", "RowsLayout", "row_layouts"]
