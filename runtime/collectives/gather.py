"""All-gather S(d) -> R over a group, for uneven (and zero-length) shards.

Variants (HAP, EuroSys'24, section 4.3; cost_models.comm):
  padded   pad every shard to the largest, one equal-size all_gather_single, unpad
  grouped  one broadcast per member of its exact shard (no padding)
  ring     g-1 point-to-point steps, each rank forwarding the shard it received last

Backward is the adjoint, reduce-scatter with the same variant: the gradient of the gathered
(replicated) tensor is Partial, and each rank receives the sum of its own slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hetsynth.runtime.collectives import ring
from hetsynth.runtime.collectives.registry import COLLECTIVE_VARIANTS
from hetsynth.runtime.collectives.span import Span, from_front, pad_rows, to_front


def gather_padded(x: torch.Tensor, span: Span) -> torch.Tensor:
    front = to_front(x, span.dim)
    rows = max(span.lengths)
    if rows == 0:
        return x.new_zeros(*[0 if i == span.dim else s for i, s in enumerate(x.shape)])
    out = front.new_empty(span.size * rows, *front.shape[1:])
    dist.all_gather_single(out, pad_rows(front, rows), group=span.group)
    chunks = [c[:n] for c, n in zip(out.split(rows), span.lengths)]
    return from_front(torch.cat(chunks), span.dim)


def gather_grouped(x: torch.Tensor, span: Span) -> torch.Tensor:
    front = to_front(x, span.dim)
    chunks = []
    for j, n in enumerate(span.lengths):
        buf = front if j == span.index else front.new_empty(n, *front.shape[1:])
        if n > 0:
            dist.broadcast(buf, src=span.members[j], group=span.group)
        chunks.append(buf)
    return from_front(torch.cat(chunks), span.dim)


def gather_ring(x: torch.Tensor, span: Span) -> torch.Tensor:
    front = to_front(x, span.dim)
    g, i = span.size, span.index
    blocks: list[torch.Tensor | None] = [None] * g
    blocks[i] = front
    for step in range(g - 1):
        send_idx, recv_idx = (i - step) % g, (i - step - 1) % g
        blocks[recv_idx] = front.new_empty(span.lengths[recv_idx], *front.shape[1:])
        ring.exchange(blocks[send_idx], blocks[recv_idx], span)
    return from_front(torch.cat(blocks), span.dim)  # type: ignore[arg-type]


for _variant, _impl in {"padded": gather_padded, "grouped": gather_grouped, "ring": gather_ring}.items():
    COLLECTIVE_VARIANTS.register("all_gather", _impl, variant=_variant)
