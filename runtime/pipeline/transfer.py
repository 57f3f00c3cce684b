"""Boundary tensors between pipeline stages: a resharding plan's send/recv chains as
non-blocking point-to-point transfers inside autograd.

Forward (activation of micro-batch m on boundary i):
  source rank   `send_forward(x)` in SEND_F: for each chain it starts, `isend` of its slice of x
                (posted, not waited: the stage goes on computing); returns a TOKEN, an empty
                tensor whose backward, run in the source's B(m), receives the slices' gradients
                (blocking) and adds them into x's gradient (zeros where nothing was sent: the
                gradient of a replicated source is Partial, as in the SPMD programs).
  destination   `receive_forward()` in RECV_F: `irecv` of every slice it receives, waited, put
                together into its box of the tensor; its backward, run in the destination's
                B(m), `isend`s the gradient of each slice back to its sender (not waited).
A Partial source is first reduce-scattered over the source stage (differentiable: its adjoint
all-gathers in the source's backward), as instruction_set.resharding prescribes.

Sends are non-blocking and receives blocking, the semantics the dry run (instruction_set.schedule)
checks the action lists under. Every posted send is kept and waited once, at the end of the step
(`Outbox.flush`: gloo must not wait a work twice). Tags tell the transfers of one pair of ranks
apart: (boundary, micro-batch, chain, direction).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from instruction_set.resharding import Box, ReshardPlan
from runtime.collectives import Span, all_reduce, reduce_scatter


@dataclass
class Outbox:
    """Posted sends of this step, waited at its end."""

    works: list[tuple[Any, torch.Tensor]] = field(default_factory=list)

    def post(self, buf: torch.Tensor, dst: int, tag: int, group: Any) -> None:
        self.works.append((dist.isend(buf, dst=dst, group=group, tag=tag), buf))

    def flush(self) -> None:
        for work, _ in self.works:
            work.wait()
        self.works.clear()


@dataclass(frozen=True)
class Link:
    """One boundary at one micro-batch seen from this rank."""

    plan: ReshardPlan
    rank: int
    world: Any           # the group of the point-to-point transfers (global ranks)
    stage_group: Any     # the source stage's group (its Partial reduction), None elsewhere
    tag_base: int
    outbox: Outbox
    dtype: torch.dtype
    reduce_first: Span | None = None  # the source stage's span, when a 0-d Partial is all-reduced first

    def box(self, side: str) -> Box | None:
        if side == "src":
            return next((t.box for t in self.plan.src_tiles if self.rank in t.holders), None)
        dst = self.plan.spec.dst
        return dst.box_of(self.rank) if self.rank in dst.ranks else None

    def chains(self, position: int) -> list[tuple[int, Any]]:
        return [(i, c) for i, c in enumerate(self.plan.chains)
                if len(c.members) == 2 and c.members[position] == self.rank]

    def tag(self, chain: int, backward: bool) -> int:
        return (self.tag_base + chain) * 2 + int(backward)


def _within(box: Box, outer: Box) -> tuple[slice, ...]:
    return box.within(outer)


class _SendForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, link: Link) -> torch.Tensor:
        ctx.link, ctx.shape = link, x.shape
        box = link.box("src")
        for i, chain in link.chains(0):
            link.outbox.post(x.detach()[_within(chain.box, box)].contiguous(), chain.members[1],
                             link.tag(i, False), link.world)
        return x.new_zeros(0)

    @staticmethod
    def backward(ctx: Any, _token: torch.Tensor) -> tuple[torch.Tensor, None]:
        link: Link = ctx.link
        grad = torch.zeros(ctx.shape, dtype=link.dtype)
        box = link.box("src")
        for i, chain in link.chains(0):
            buf = torch.empty(chain.box.shape, dtype=link.dtype)
            dist.recv(buf, src=chain.members[1], group=link.world, tag=link.tag(i, True))
            grad[_within(chain.box, box)] += buf
        return grad, None


class _ReceiveForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, link: Link) -> torch.Tensor:
        ctx.link = link
        box = link.box("dst")
        out = torch.empty(box.shape, dtype=link.dtype)
        works = []
        for i, chain in link.chains(1):
            buf = torch.empty(chain.box.shape, dtype=link.dtype)
            works.append((dist.irecv(buf, src=chain.members[0], group=link.world, tag=link.tag(i, False)), chain, buf))
        for work, chain, buf in works:
            work.wait()
            out[_within(chain.box, box)] = buf
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        link: Link = ctx.link
        box = link.box("dst")
        for i, chain in link.chains(1):
            link.outbox.post(grad[_within(chain.box, box)].contiguous(), chain.members[0], link.tag(i, True), link.world)
        return None, None


def send_forward(x: torch.Tensor, link: Link) -> torch.Tensor:
    """Post this rank's slices of a boundary tensor (module docstring); returns the token to
    differentiate in B(m)."""
    red = link.plan.source_reduction
    if link.reduce_first is not None:  # a 0-d Partial source: summed on the source stage (planner.pipeline)
        x = all_reduce(x, link.reduce_first)
    if red is not None:
        members = link.plan.spec.src.ranks
        x = reduce_scatter(x, Span(link.stage_group, members, members.index(link.rank), red.dim, red.lengths),
                           red.variant)
    return _SendForward.apply(x, link)


def receive_forward(link: Link, requires_grad: bool) -> torch.Tensor:
    """This rank's box of a boundary tensor, received (module docstring)."""
    anchor = torch.zeros(0, dtype=link.dtype, requires_grad=requires_grad)
    return _ReceiveForward.apply(anchor, link)
