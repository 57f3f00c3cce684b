"""Executing a resharding plan (instruction_set.resharding, planned by planner.resharding) with
point-to-point chains (runtime.collectives.chain), as an autograd function.

Every rank of the source and destination meshes calls `reshard` (others must not); the group is
passed explicitly and nothing else is synchronised (no barrier). A rank runs the rounds of its
chains in increasing (phase, order): the chains of one round at once, then it copies what it
received into its destination tensor (phase 1 chains, the local all-gather, forward what phase
0 delivered). Deadlock-free: take the unfinished round with the smallest key; each of its
members has finished its smaller rounds, so all are in it, and a round completes
(runtime.collectives.chain).

Forward: source layout (x, this rank's box of the source; a Partial source is reduce-scattered
over the source ranks first, ring, differentiable) -> destination layout (this rank's box; an
empty tensor on a rank outside the destination). Backward, the adjoint: the same chains reversed
in reverse round order, adding: the gradient of a slice that several receivers hold is summed
along its chain back to its sender, a replica that sent nothing gets zeros (the gradient of a
replicated source is Partial); then the reduce-scatter's adjoint, a ring all-gather.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from hetsynth.instruction_set.resharding import Box, Chain, ReshardPlan
from hetsynth.runtime.collectives import Span, reduce_scatter
from hetsynth.runtime.collectives.chain import Leg, run_round


@dataclass(frozen=True)
class ReshardContext:
    plan: ReshardPlan
    rank: int
    group: Any
    tag_base: int = 0
    requires_grad: bool = True  # whether a destination-only rank's output takes a gradient

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.plan.spec.dtype)


def src_box(plan: ReshardPlan, rank: int) -> Box | None:
    """This rank's box of the (reduced) source, None when it holds none of it."""
    return next((t.box for t in plan.src_tiles if rank in t.holders), None)


def dst_box(plan: ReshardPlan, rank: int) -> Box | None:
    dst = plan.spec.dst
    return dst.box_of(rank) if rank in dst.ranks else None


def _rounds(plan: ReshardPlan, rank: int) -> list[list[tuple[int, Chain]]]:
    by_key: dict[tuple[int, int], list[tuple[int, Chain]]] = defaultdict(list)
    for i, chain in plan.rank_chains(rank):
        by_key[chain.key].append((i, chain))
    return [by_key[k] for k in sorted(by_key)]


def _index(box: Box, outer: Box | None) -> tuple[slice, ...]:
    assert outer is not None
    return box.within(outer)


def forward_exchange(plan: ReshardPlan, rank: int, x: torch.Tensor | None, *, group: Any,
                     tag_base: int = 0) -> torch.Tensor | None:
    """This rank's destination tensor (None outside the destination) from its source tensor."""
    sbox, dbox = src_box(plan, rank), dst_box(plan, rank)
    dtype = getattr(torch, plan.spec.dtype)
    out = torch.empty(dbox.shape, dtype=dtype) if dbox is not None else None
    if sbox is not None and (x is None or tuple(x.shape) != sbox.shape):
        raise ValueError(f"tensor {plan.spec.tensor!r}: rank {rank} holds {None if x is None else list(x.shape)} "
                         f"of the source ({plan.spec.src.describe}), its box {sbox.start}..{sbox.stop} is "
                         f"{list(sbox.shape)}")
    for chains in _rounds(plan, rank):
        legs, landed = [], []
        for i, chain in chains:
            pos = chain.members.index(rank)
            if len(chain.members) == 1:
                out[_index(chain.box, dbox)] = x[_index(chain.box, sbox)]
                continue
            if pos == 0:
                held = x[_index(chain.box, sbox)] if chain.phase == 0 else out[_index(chain.box, dbox)]
                buf = held.contiguous().reshape(-1)
            else:
                buf = torch.empty(chain.box.numel, dtype=dtype)
                landed.append((chain.box, buf))
            legs.append(_leg(chain, pos, buf, tag_base + i))
        run_round(legs, group=group, rank=rank)
        for box, buf in landed:
            out[_index(box, dbox)] = buf.view(box.shape)
    return out


def _leg(chain: Chain, pos: int, buf: torch.Tensor, tag: int, reverse: bool = False,
         staging: torch.Tensor | None = None) -> Leg:
    members = chain.members[::-1] if reverse else chain.members
    at = members.index(chain.members[pos])
    return Leg(prev=members[at - 1] if at > 0 else None, nxt=members[at + 1] if at + 1 < len(members) else None,
               buf=buf, chunk=chain.chunk_elems, tag=tag, staging=staging)


def adjoint_exchange(plan: ReshardPlan, rank: int, grad: torch.Tensor | None, *, group: Any,
                     tag_base: int = 0) -> torch.Tensor | None:
    """The gradient of this rank's source tensor (None outside the source) from the gradient
    of its destination tensor: the chains reversed, summing."""
    sbox, dbox = src_box(plan, rank), dst_box(plan, rank)
    dtype = getattr(torch, plan.spec.dtype)
    g = grad.detach().clone() if grad is not None else None
    gx = torch.zeros(sbox.shape, dtype=dtype) if sbox is not None else None
    for chains in reversed(_rounds(plan, rank)):
        legs, sums = [], []
        for i, chain in chains:
            pos = chain.members.index(rank)
            if len(chain.members) == 1:
                gx[_index(chain.box, sbox)] += g[_index(chain.box, dbox)]
                continue
            own = (g[_index(chain.box, dbox)].reshape(-1).clone() if pos > 0 or chain.phase == 1
                   else torch.zeros(chain.box.numel, dtype=dtype))
            legs.append(_leg(chain, pos, own, tag_base + i, reverse=True,
                             staging=torch.empty_like(own) if pos < len(chain.members) - 1 else None))
            if pos == 0:  # the chain's first member ends its adjoint with the sum
                sums.append((chain, own))
        run_round(legs, group=group, rank=rank)
        for chain, total in sums:
            if chain.phase == 0:
                gx[_index(chain.box, sbox)] += total.view(chain.box.shape)
            else:
                g[_index(chain.box, dbox)] = total.view(chain.box.shape)
    return gx


class _Reshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rctx: ReshardContext) -> torch.Tensor:
        ctx.rctx, ctx.x_shape = rctx, x.shape
        held = x.detach() if src_box(rctx.plan, rctx.rank) is not None else None
        out = forward_exchange(rctx.plan, rctx.rank, held, group=rctx.group, tag_base=rctx.tag_base)
        return out if out is not None else x.new_empty(0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        rctx: ReshardContext = ctx.rctx
        has_dst = dst_box(rctx.plan, rctx.rank) is not None
        gx = adjoint_exchange(rctx.plan, rctx.rank, grad if has_dst else None, group=rctx.group,
                              tag_base=rctx.tag_base)
        return (gx if gx is not None else grad.new_zeros(ctx.x_shape)), None


def reshard(x: torch.Tensor | None, ctx: ReshardContext) -> torch.Tensor:
    """Source layout -> destination layout (module docstring). `x`: this rank's tensor in the
    source layout (None on a destination-only rank). Returns this rank's tensor in the
    destination layout, or an empty tensor on a source-only rank, whose backward (drive it with
    an empty gradient) takes part in the adjoint. Every rank that called it must run its
    backward when any did."""
    plan, spec = ctx.plan, ctx.plan.spec
    if x is not None and plan.source_reduction is not None:
        red = plan.source_reduction
        members = spec.src.ranks
        x = reduce_scatter(x, Span(ctx.group, members, members.index(ctx.rank), red.dim, red.lengths), red.variant)
    if x is None:
        x = torch.zeros(0, dtype=ctx.dtype, requires_grad=ctx.requires_grad)
    return _Reshard.apply(x, ctx)
