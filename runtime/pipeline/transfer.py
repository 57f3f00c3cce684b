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

Receives are posted AHEAD of the actions that need them, because gloo's point-to-point is a
rendezvous (the data of an `isend` moves only once the peer has posted the matching `irecv`):
a receive posted only when its action starts would put every transfer on the receiver's
critical path, whatever the schedule. So a destination posts the receives of all its
micro-batches' activations when the step starts (`post_receive`; RECV_F then waits for them),
and a source posts the receive of micro-batch m's gradient when it sends m's activation
(`send_forward`; its backward waits for it). gloo moves the bytes on its own threads while the
stage computes: the overlap eager-1F1B counts on (cost_models.schedule). Every posted work is
waited exactly once (gloo must not wait a work twice): sends at the end of the step
(`Outbox.flush`), receives where their data is used. The dry run (instruction_set.schedule)
checks the action lists under blocking receives, which posting ahead only relaxes. Tags tell
the transfers of one pair of ranks apart: (boundary, micro-batch, chain, direction).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hetsynth.instruction_set.resharding import Box, ReshardPlan
from hetsynth.runtime.collectives import Span, all_reduce, reduce_scatter


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


@dataclass
class Posted:
    """Receives posted ahead: (work, chain, buffer) each, waited once by `take`."""

    link: Link
    works: list[tuple[Any, Any, torch.Tensor]]

    @staticmethod
    def post(link: Link, position: int, backward: bool) -> "Posted":
        """irecv of every slice this rank receives on `link` (position 1: as destination of
        the activation; 0: as source, of its gradient)."""
        works = []
        for i, chain in link.chains(position):
            buf = torch.empty(chain.box.shape, dtype=link.dtype)
            works.append((dist.irecv(buf, src=chain.members[1 - position], group=link.world,
                                     tag=link.tag(i, backward)), chain, buf))
        return Posted(link, works)

    def take(self, out: torch.Tensor, outer: Box, add: bool) -> torch.Tensor:
        """Wait for every slice and put (add: add) it into its box of `out` (whose box is `outer`)."""
        for work, chain, buf in self.works:
            work.wait()
            if add:
                out[_within(chain.box, outer)] += buf
            else:
                out[_within(chain.box, outer)] = buf
        self.works = []
        return out


class _SendForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, link: Link) -> torch.Tensor:
        ctx.link, ctx.shape = link, x.shape
        box = link.box("src")
        for i, chain in link.chains(0):
            link.outbox.post(x.detach()[_within(chain.box, box)].contiguous(), chain.members[1],
                             link.tag(i, False), link.world)
        ctx.posted = Posted.post(link, 0, True) if ctx.needs_input_grad[0] else None  # the gradient, ahead
        return x.new_zeros(0)

    @staticmethod
    def backward(ctx: Any, _token: torch.Tensor) -> tuple[torch.Tensor, None]:
        link: Link = ctx.link
        grad = torch.zeros(ctx.shape, dtype=link.dtype)
        return ctx.posted.take(grad, link.box("src"), add=True), None


class _ReceiveForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, posted: Posted) -> torch.Tensor:
        link = ctx.link = posted.link
        box = link.box("dst")
        return posted.take(torch.empty(box.shape, dtype=link.dtype), box, add=False)

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
    if x.is_floating_point() and x.dtype != link.dtype:  # a 16-bit activation (runtime.mixed_precision)
        x = x.to(link.dtype)
    if link.reduce_first is not None:  # a 0-d Partial source: summed on the source stage (planner.pipeline)
        x = all_reduce(x, link.reduce_first)
    if red is not None:
        members = link.plan.spec.src.ranks
        x = reduce_scatter(x, Span(link.stage_group, members, members.index(link.rank), red.dim, red.lengths),
                           red.variant)
    return _SendForward.apply(x, link)


def post_receive(link: Link) -> Posted:
    """Post the receives of this rank's slices of a boundary tensor (module docstring)."""
    return Posted.post(link, 1, False)


def receive_forward(posted: Posted, requires_grad: bool) -> torch.Tensor:
    """This rank's box of a boundary tensor, from its posted receives (module docstring)."""
    anchor = torch.zeros(0, dtype=posted.link.dtype, requires_grad=requires_grad)
    return _ReceiveForward.apply(anchor, posted)
