"""ZeRO-3 / FSDP on one rank: a parameter stored only as this rank's rows, gathered at each use.

A ZeRO-3 parameter (instruction_set.training_state) is an nn.Parameter of this rank's rows of
dim 0 (the plan's `state_shards.rows`, uneven, zero rows legal): the optimizer, its state and
its gradient hold the rows only. The generated program (runtime.codegen) reads it through a
`GatherParamModule` call at every op that uses it:

    forward   W = all_gather(rows)             (uneven rows; the plan's all-gather variant)
    backward  d rows = reduce_scatter(dW)      (this rank's rows of the sum over ranks; the
                                                plan's scatter variant)

so a tied weight used twice is gathered twice and its two gradients reduce-scattered and
accumulated on the rows. W is released after its forward uses: while `ParamGathers.releasing()`
is active (runtime.train, around the forward), a saved-tensors hook packs a tensor that shares
W's storage as a handle instead of the tensor, and unpacking it in the backward gathers the
rows again (the second gather); fx's generated code drops W after its last forward use. Other
saved tensors go to the hooks that were active when `releasing()` began (the memory report's
meter), or are kept as they are. Every rank gathers, regathers and reduce-scatters in the same
order: the program and its backward graph are the same on every rank.

The gather and the reduce-scatter run synchronously on the autograd thread (not in the
overlapped gradient buckets of runtime.grad_sync).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch
from torch import nn

from runtime.collectives import COLLECTIVE_VARIANTS, Span


class GatherParam(torch.autograd.Function):
    """rows -> the whole parameter; backward: the whole gradient reduce-scattered onto the rows."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, owner: "GatherParamModule") -> torch.Tensor:
        ctx.owner = owner
        whole = owner.gather(rows)
        owner.gathers.register(whole, owner, rows)
        return whole

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return ctx.owner.scatter(grad.contiguous()), None


class GatherParamModule(nn.Module):
    """One ZeRO-3 parameter's gather at a use (module docstring); `span`: dim 0, its rows."""

    def __init__(self, span: Span, variant: str, scatter_variant: str, gathers: "ParamGathers") -> None:
        super().__init__()
        self.span, self.variant, self.scatter_variant, self.gathers = span, variant, scatter_variant, gathers

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return COLLECTIVE_VARIANTS.get("all_gather", variant=self.variant)(rows.detach(), self.span)

    def scatter(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the summed gradient, in storage of their own (the padded
        variant's result is a view of rows padded to the largest rank's)."""
        with torch.no_grad():
            rows = COLLECTIVE_VARIANTS.get("reduce_scatter", variant=self.scatter_variant)(grad, self.span)
        return rows.clone() if rows.untyped_storage().nbytes() > rows.numel() * rows.element_size() else rows

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return GatherParam.apply(rows, self)


class _Regather:
    """A released view of a gathered parameter: gathered again when the backward needs it."""

    def __init__(self, owner: GatherParamModule, rows: torch.Tensor, t: torch.Tensor) -> None:
        self.owner, self.rows = owner, rows
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()

    def tensor(self) -> torch.Tensor:
        return self.owner.gather(self.rows).as_strided(self.size, self.stride, self.offset)


class ParamGathers:
    """The gathered parameters of the forward in flight, by storage (module docstring)."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[weakref.ref, GatherParamModule, torch.Tensor]] = {}
        self.regathers = 0

    def register(self, whole: torch.Tensor, owner: GatherParamModule, rows: torch.Tensor) -> None:
        if whole.numel():
            self.live[whole.untyped_storage().data_ptr()] = (weakref.ref(whole), owner, rows)

    def _match(self, t: torch.Tensor) -> tuple[GatherParamModule, torch.Tensor] | None:
        if not t.numel() or t.device.type == "meta":
            return None
        entry = self.live.get(t.untyped_storage().data_ptr())
        if entry is None or entry[0]() is None:  # a dead entry: the address may have been reused
            return None
        return entry[1], entry[2]

    @contextlib.contextmanager
    def releasing(self) -> Iterator[None]:
        """Saved-tensors hooks that release gathered parameters (composed with the outer hooks)."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)

        def pack(t: torch.Tensor) -> Any:
            found = self._match(t)
            if found is not None:
                return _Regather(found[0], found[1], t)
            return ("outer", outer[0](t)) if outer is not None else ("kept", t)

        def unpack(x: Any) -> torch.Tensor:
            if isinstance(x, _Regather):
                self.regathers += 1
                return x.tensor()
            return outer[1](x[1]) if x[0] == "outer" else x[1]  # type: ignore[index, misc]

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            self.live.clear()


__all__ = ["GatherParam", "GatherParamModule", "ParamGathers"]
