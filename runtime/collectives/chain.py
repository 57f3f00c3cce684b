"""Pipelined chains over point-to-point sends (the forward and adjoint of a resharding round).

A chain moves a flat buffer along its members in chunks: member 0 sends chunk c to member 1,
which forwards it to member 2 as soon as it has it, and so on (the pipelined broadcast of
Thakur et al., IJHPCA 2005; gloo's own broadcast is an unpipelined binomial tree, and NCCL's
ring broadcast is this chain). Its adjoint runs the members in reverse order and adds: each
member adds the chunk it receives into its own contribution and sends the sum on, so the
last one ends with the sum over all members (the gradient of a replicated tensor is Partial).

`run_round` runs several chains at once: every receive of the round is posted first, then the
rank walks the chunks, chunk-major and chain by chain in chain order, waiting for each chunk
it receives and sending each chunk it forwards; at the end it waits for its sends. Every work
is waited exactly once (a second wait on a gloo point-to-point work can hang). No deadlock:
order the events (chunk, chain, position in the chain); an event waits only for the event
one position earlier, which its rank reaches after events that are all smaller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class ChainError(RuntimeError):
    """A chunk that did not arrive (peer dead or stalled); names the ranks and the chunk."""


@dataclass
class Leg:
    """My part in one chain: the previous and next member (global ranks), the flat buffer I
    forward (a receiver's chunks land in it), and for an adjoint a staging buffer whose
    received chunks are added into `buf` before they go on."""

    prev: int | None
    nxt: int | None
    buf: torch.Tensor
    chunk: int
    tag: int
    staging: torch.Tensor | None = None

    def chunks(self, t: torch.Tensor) -> list[torch.Tensor]:
        return list(t.split(self.chunk)) if t.numel() else []


def run_round(legs: list[Leg], *, group: Any, rank: int) -> None:
    """Run the chains of one round on this rank (module docstring)."""
    recvs = [[dist.irecv(c, leg.prev, group=group, tag=leg.tag) for c in leg.chunks(_landing(leg))]
             if leg.prev is not None else [] for leg in legs]
    parts = [leg.chunks(leg.buf) for leg in legs]
    staged = [leg.chunks(leg.staging) if leg.staging is not None else [] for leg in legs]
    sends = []
    for c in range(max((len(p) for p in parts), default=0)):
        for k, leg in enumerate(legs):
            if c >= len(parts[k]):
                continue
            if leg.prev is not None:
                _wait(recvs[k][c], f"rank {rank} waited for chunk {c + 1}/{len(parts[k])} of chain tag "
                                   f"{leg.tag} from rank {leg.prev}")
                if staged[k]:
                    parts[k][c].add_(staged[k][c])
            if leg.nxt is not None:
                sends.append((dist.isend(parts[k][c], leg.nxt, group=group, tag=leg.tag), leg))
    for work, leg in sends:
        _wait(work, f"rank {rank} waited for rank {leg.nxt} to take chain tag {leg.tag}")


def _landing(leg: Leg) -> torch.Tensor:
    return leg.staging if leg.staging is not None else leg.buf


def _wait(work: Any, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as err:
        raise ChainError(f"{what}: {err}") from err
