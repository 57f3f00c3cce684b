"""The autograd function of a collective whose backward is another collective of the same
variant on the same span: all-gather S(d) -> R has reduce-scatter P -> S(d) as its adjoint,
and the reverse (HAP, EuroSys'24: the distributed program covers the forward pass only)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from runtime.collectives.gather import GATHER
from runtime.collectives.scatter import SCATTER
from runtime.collectives.span import Span

Impl = Callable[[torch.Tensor, Span], torch.Tensor]


class Adjoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, span: Span, forward_impl: Impl, backward_impl: Impl) -> torch.Tensor:
        ctx.span, ctx.backward_impl = span, backward_impl
        return forward_impl(x, span)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return ctx.backward_impl(grad, ctx.span), None, None, None


def all_gather(x: torch.Tensor, span: Span, variant: str = "padded") -> torch.Tensor:
    """S(d) -> R; backward: reduce-scatter P -> S(d) of the same variant."""
    return Adjoint.apply(x, span, GATHER[variant], SCATTER[variant])


def reduce_scatter(x: torch.Tensor, span: Span, variant: str = "padded") -> torch.Tensor:
    """P -> S(d); backward: all-gather S(d) -> R of the same variant."""
    return Adjoint.apply(x, span, SCATTER[variant], GATHER[variant])
