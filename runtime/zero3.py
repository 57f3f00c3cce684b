"""ZeRO-3 / FSDP on one rank: a parameter stored only as this rank's rows, gathered at each use.

A ZeRO-3 parameter (instruction_set.training_state) is an nn.Parameter of this rank's rows of
dim 0 (the plan's `state_shards.rows`, uneven, zero rows legal): the optimizer, its state and
its gradient hold the rows only. The generated program (runtime.codegen) reads it through a
`GatherParamModule` call at every op that uses it:

    forward   W = all_gather(rows)             (uneven rows; the plan's all-gather variant)
    backward  d rows = reduce_scatter(dW)      (this rank's rows of the sum over ranks; the
                                                plan's scatter variant)

so a tied weight used twice is gathered twice (two uses) and its two gradients
reduce-scattered and accumulated on the rows. W is released after its forward use: while
`ParamGathers.releasing()` is active (around the forward), a saved-tensors hook packs a tensor
that shares W's storage as a handle instead of the tensor, and fx's generated code drops W
after its use. Other saved tensors go to the hooks that were active when `releasing()` began
(the memory report's meter), or are kept as they are.

Every rank must issue the same collectives in the same order. The autograd engine orders a
backward by each rank's own graph, and the graphs differ: where a rank's shard of an op's
output is empty, the program runs `instruction_set.local.empty_result` instead of the op, a
graph that saves nothing, so no hook of it fires in the backward. The backward's collectives
are therefore issued by a chain of autograd Functions, the same on every rank:

    token -> GatherParam (use 1) -> ... -> RegatherPoint (op X) -> GatherParam -> ... -> ChainEnd(loss)

Each link takes the token of the link before it and makes the next; `ChainEnd` passes the
loss through unchanged and gives the last token a zero gradient. A link's backward needs its
output token's gradient, so it runs after the backward of every later link: on every rank the
links' backwards run in the reverse of the forward's order, whatever the rest of the graph.
The links that communicate:

    GatherParam     backward: reduce_scatter(dW) of its use
    RegatherPoint   wraps the outputs of an op X that reads gathered parameters; its backward
                    runs before X's (X's output gradients pass through it) and gathers again
                    each of X's uses that some rank saved; the handles unpacked in X's
                    backward read those tensors (no collective there)

Which uses were saved is known only where the op ran: at the end of the forward
(`releasing()`'s exit, the same point of the program on every rank) the ranks all-reduce (max)
one flag per use, so all regather the same uses. A regathered W is dropped at its use's
reduce-scatter (X's backward, its only reader, is done then). Each link saves its token, so
that inside a recomputed block (runtime.recompute) the link's backward rebuilds the block on
every rank, not only where the block saved other tensors.

The gathers and reduce-scatters run synchronously on the autograd thread (not in the
overlapped gradient buckets of runtime.grad_sync).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from hetsynth.runtime.collectives import COLLECTIVE_VARIANTS, Span
from hetsynth.runtime.mixed_precision import reduced


class GatherParamModule(nn.Module):
    """One ZeRO-3 parameter's gathers (module docstring); `span`: dim 0, its rows. Called at
    each use with the chain's token: (rows, token) -> (W, next token)."""

    def __init__(self, span: Span, variant: str, scatter_variant: str, gathers: "ParamGathers",
                 wire: torch.dtype | None = None) -> None:
        super().__init__()
        self.span, self.variant, self.scatter_variant, self.gathers = span, variant, scatter_variant, gathers
        self.wire = wire  # the dtype the gradient's reduce-scatter carries (runtime.mixed_precision.gradient_wire)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return COLLECTIVE_VARIANTS.get("all_gather", variant=self.variant)(rows.detach(), self.span)

    def scatter(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the summed gradient, in storage of their own (the padded
        variant's result is a view of rows padded to the largest rank's)."""
        with torch.no_grad():
            scatter = COLLECTIVE_VARIANTS.get("reduce_scatter", variant=self.scatter_variant)
            rows = reduced(lambda g: scatter(g, self.span), grad, self.wire)
        return rows.clone() if rows.untyped_storage().nbytes() > rows.numel() * rows.element_size() else rows

    def forward(self, rows: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return GatherParam.apply(rows, token, self)


@dataclass
class ForwardPass:
    """One forward's uses and what its backward regathers. Use u is the forward's u-th gather,
    the same use on every rank (the program is)."""
    uses: list[tuple[GatherParamModule, torch.Tensor]] = field(default_factory=list)  # (owner, rows)
    pending: list[int] = field(default_factory=list)   # uses not yet claimed by a RegatherPoint
    live: dict[int, tuple[weakref.ref, int]] = field(default_factory=dict)  # W's storage -> (W, use)
    saved: set[int] = field(default_factory=set)       # uses whose W this rank's graph saved
    needed: set[int] = field(default_factory=set)      # uses some rank's graph saved
    regathered: dict[int, torch.Tensor] = field(default_factory=dict)

    def add_use(self, owner: GatherParamModule, rows: torch.Tensor) -> int:
        self.uses.append((owner, rows))
        self.pending.append(len(self.uses) - 1)
        return len(self.uses) - 1

    def claim(self) -> tuple[int, ...]:
        """The uses gathered since the last RegatherPoint: the op about to be wrapped reads them."""
        uses, self.pending = tuple(self.pending), []
        return uses

    def register(self, whole: torch.Tensor, use: int) -> None:
        if whole.numel():
            self.live[whole.untyped_storage().data_ptr()] = (weakref.ref(whole), use)

    def match(self, t: torch.Tensor) -> int | None:
        """The use whose W (alive) shares `t`'s storage, if any."""
        if not t.numel() or t.device.type == "meta":
            return None
        entry = self.live.get(t.untyped_storage().data_ptr())
        if entry is None or entry[0]() is None:  # a dead entry: the address may have been reused
            return None
        return entry[1]

    def agree(self) -> None:
        """needed = the uses any rank saved: one all-reduce (max) of a flag per use (the empty
        rank's graph saves none of them, and must regather what the others do)."""
        if not self.uses:
            return
        owner, rows = self.uses[0]
        flags = torch.zeros(len(self.uses), dtype=torch.int32, device=rows.device)
        flags[sorted(self.saved)] = 1
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=owner.span.group)
        self.needed = {u for u, f in enumerate(flags.tolist()) if f}


class GatherParam(torch.autograd.Function):
    """(rows, token) -> (the whole parameter, next token); backward, after every later link's:
    the whole gradient reduce-scattered onto the rows."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, token: torch.Tensor, owner: GatherParamModule) -> tuple:
        ctx.owner, ctx.pass_ = owner, owner.gathers.current
        ctx.use = ctx.pass_.add_use(owner, rows)
        ctx.save_for_backward(token)
        whole = owner.gather(rows)
        ctx.pass_.register(whole, ctx.use)
        return whole, torch.zeros_like(token)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _token: torch.Tensor) -> tuple:
        (token,) = ctx.saved_tensors
        ctx.pass_.regathered.pop(ctx.use, None)
        return ctx.owner.scatter(grad.contiguous()), torch.zeros_like(token), None


class RegatherPoint(torch.autograd.Function):
    """(token, *outputs of op X) -> (next token, *the same outputs); backward, before X's:
    gather again X's uses that a rank saved (module docstring)."""

    @staticmethod
    def forward(ctx: Any, token: torch.Tensor, gathers: "ParamGathers", pass_: ForwardPass, uses: tuple[int, ...],
                *outs: torch.Tensor) -> tuple:
        ctx.gathers, ctx.pass_, ctx.uses = gathers, pass_, uses
        ctx.save_for_backward(token)
        return (torch.zeros_like(token), *(o.view_as(o) for o in outs))

    @staticmethod
    def backward(ctx: Any, _token: torch.Tensor, *grads: torch.Tensor) -> tuple:
        (token,) = ctx.saved_tensors
        ctx.gathers.regather(ctx.pass_, ctx.uses)
        return (torch.zeros_like(token), None, None, None, *grads)


class RegatherPointModule(nn.Module):
    """A RegatherPoint on an op's value (a tensor, or a tuple of outputs: its floating ones go
    through the point, the others pass by): (token, value) -> (next token, value)."""

    def __init__(self, gathers: "ParamGathers") -> None:
        super().__init__()
        self.gathers = gathers

    def forward(self, token: torch.Tensor, value: Any) -> tuple[torch.Tensor, Any]:
        pass_ = self.gathers.current
        items = list(value) if isinstance(value, (tuple, list)) else [value]
        wrapped = [i for i, v in enumerate(items) if _differentiable(v)]
        token, *outs = RegatherPoint.apply(token, self.gathers, pass_, pass_.claim(), *[items[i] for i in wrapped])
        for i, out in zip(wrapped, outs):
            items[i] = out
        return token, (tuple(items) if isinstance(value, (tuple, list)) else items[0])


def _differentiable(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


class ChainEnd(torch.autograd.Function):
    """(loss, last token) -> the loss; backward: the loss's gradient, a zero for the token
    (which starts the links' backwards, in order)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        ctx.token_like = (token.shape, token.dtype, token.device)
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        shape, dtype, device = ctx.token_like
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def chain_start(device: torch.device) -> torch.Tensor:
    """The chain's first token: a scalar zero that requires grad (so every link's output does,
    whatever its parameter)."""
    return torch.zeros((), device=device, requires_grad=torch.is_grad_enabled())


def chain_end(loss: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    return ChainEnd.apply(loss, token) if torch.is_grad_enabled() and token.requires_grad else loss


class _Released:
    """A saved view of a gathered W, released: its use and where the view lies in W."""

    def __init__(self, pass_: ForwardPass, use: int, t: torch.Tensor) -> None:
        self.pass_, self.use = pass_, use
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()

    def tensor(self) -> torch.Tensor:
        whole = self.pass_.regathered.get(self.use)
        if whole is None:
            raise RuntimeError(f"ZeRO-3: the backward read the released parameter of use {self.use} before its "
                               f"RegatherPoint gathered it again (runtime.zero3)")
        return whole.as_strided(self.size, self.stride, self.offset)


class ParamGathers:
    """The ZeRO-3 gathers of a program: the forward in flight (`current`) and the regathers."""

    def __init__(self) -> None:
        self.current = ForwardPass()
        self.regathers = 0

    def regather(self, pass_: ForwardPass, uses: tuple[int, ...]) -> None:
        """Gather again, in use order, the uses of `uses` that some rank saved."""
        for u in uses:
            if u in pass_.needed:
                owner, rows = pass_.uses[u]
                pass_.regathered[u] = owner.gather(rows)
                self.regathers += 1

    @contextlib.contextmanager
    def releasing(self) -> Iterator[None]:
        """A new forward whose gathered parameters are released: saved-tensors hooks composed
        with the outer hooks; at the end, the ranks agree on what the backward regathers."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        pass_ = self.current = ForwardPass()

        def pack(t: torch.Tensor) -> Any:
            use = pass_.match(t)
            if use is not None:
                pass_.saved.add(use)
                return _Released(pass_, use, t)
            return ("outer", outer[0](t)) if outer is not None else ("kept", t)

        def unpack(x: Any) -> torch.Tensor:
            if isinstance(x, _Released):
                return x.tensor()
            return outer[1](x[1]) if x[0] == "outer" else x[1]  # type: ignore[index, misc]

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
            pass_.agree()
        finally:
            pass_.live.clear()


__all__ = ["ChainEnd", "ForwardPass", "GatherParam", "GatherParamModule", "ParamGathers", "RegatherPoint",
           "RegatherPointModule", "chain_end", "chain_start"]
