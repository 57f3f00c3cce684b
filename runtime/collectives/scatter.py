"""Reduce-scatter P -> S(d) over a group, for uneven (and zero-length) shards.

Every rank holds a full-size summand; member j ends with the sum of slice j.
Variants:
  padded   pad every slice to the largest, one equal-size reduce_scatter_single, unpad
  grouped  one reduce of slice j to member j, for every j (no padding)
  ring     g-1 point-to-point steps accumulating partial sums around the ring, run the
           other way round from the ring all-gather (its exact adjoint): slice j travels
           j-1 -> j-2 -> ... -> j, the path of the all-gather's block j reversed, so it
           crosses the same node boundaries (cost_models.comm)

Backward is the adjoint, all-gather with the same variant.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hetsynth.runtime.collectives import ring
from hetsynth.runtime.collectives.registry import COLLECTIVE_VARIANTS
from hetsynth.runtime.collectives.span import Span, from_front, pad_rows, to_front


def scatter_padded(x: torch.Tensor, span: Span) -> torch.Tensor:
    front = to_front(x, span.dim)
    rows = max(span.lengths)
    if rows == 0:
        return from_front(front[:0], span.dim)
    chunks = [pad_rows(c, rows) for c in front.split(list(span.lengths))]
    out = front.new_empty(rows, *front.shape[1:])
    dist.reduce_scatter_single(out, torch.cat(chunks), op=dist.ReduceOp.SUM, group=span.group)
    return from_front(out[:span.my_length], span.dim)


def scatter_grouped(x: torch.Tensor, span: Span) -> torch.Tensor:
    front = to_front(x, span.dim)
    mine = None
    for j, chunk in enumerate(front.split(list(span.lengths))):
        buf = chunk.clone()
        if chunk.shape[0] > 0:
            dist.reduce(buf, dst=span.members[j], op=dist.ReduceOp.SUM, group=span.group)
        if j == span.index:
            mine = buf
    return from_front(mine, span.dim)  # type: ignore[arg-type]


def scatter_ring(x: torch.Tensor, span: Span) -> torch.Tensor:
    front = to_front(x, span.dim)
    g, i = span.size, span.index
    acc = [c.clone() for c in front.split(list(span.lengths))]
    for step in range(g - 1):
        send_idx, recv_idx = (i + step + 1) % g, (i + step + 2) % g
        tmp = front.new_empty(span.lengths[recv_idx], *front.shape[1:])
        ring.exchange(acc[send_idx], tmp, span, direction=-1)
        acc[recv_idx] = acc[recv_idx] + tmp
    return from_front(acc[i], span.dim)


for _variant, _impl in {"padded": scatter_padded, "grouped": scatter_grouped, "ring": scatter_ring}.items():
    COLLECTIVE_VARIANTS.register("reduce_scatter", _impl, variant=_variant)
