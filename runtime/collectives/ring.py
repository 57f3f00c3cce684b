"""One step of a ring over a group's members: send to the next member, receive from the
previous one. The ring all-gather and reduce-scatter are g-1 such steps."""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.collectives.span import Span


def exchange(send: torch.Tensor | None, recv: torch.Tensor | None, span: Span, direction: int = 1) -> None:
    """Send to the next member and receive from the previous one (each wait exactly once);
    `direction` -1 runs the ring the other way round."""
    nxt = span.members[(span.index + direction) % span.size]
    prev = span.members[(span.index - direction) % span.size]
    ops = []
    if send is not None and send.numel() > 0:
        ops.append(dist.P2POp(dist.isend, send.contiguous(), nxt, group=span.group))
    if recv is not None and recv.numel() > 0:
        ops.append(dist.P2POp(dist.irecv, recv, prev, group=span.group))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
