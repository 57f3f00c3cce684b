"""The autograd function of a collective whose backward is another collective of the same
variant on the same span: all-gather S(d) -> R has reduce-scatter P -> S(d) as its adjoint,
and the reverse (HAP, EuroSys'24: the distributed program covers the forward pass only)."""

from __future__ import annotations

from typing import Any

import torch

from hetsynth.instruction_set.kinds import kind
from hetsynth.runtime.collectives import gather, scatter  # noqa: F401  (they register their variants)
from hetsynth.runtime.collectives.registry import COLLECTIVE_VARIANTS, Impl
from hetsynth.runtime.collectives.span import Span


class Adjoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, span: Span, forward_impl: Impl, backward_impl: Impl) -> torch.Tensor:
        ctx.span, ctx.backward_impl = span, backward_impl
        return forward_impl(x, span)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return ctx.backward_impl(grad, ctx.span), None, None, None


def with_adjoint(name: str, x: torch.Tensor, span: Span, variant: str) -> torch.Tensor:
    """The collective `name` (variant) whose backward is its kind's adjoint (its variant)."""
    back = kind(name).adjoint_variant(variant)
    assert back is not None, f"{name} has no adjoint"
    return Adjoint.apply(x, span, COLLECTIVE_VARIANTS.get(name, variant=variant),
                         COLLECTIVE_VARIANTS.get(back[0].name, variant=back[1]))


def all_gather(x: torch.Tensor, span: Span, variant: str = "padded") -> torch.Tensor:
    """S(d) -> R; backward: reduce-scatter P -> S(d) of the same variant."""
    return with_adjoint("all_gather", x, span, variant)


def reduce_scatter(x: torch.Tensor, span: Span, variant: str = "padded") -> torch.Tensor:
    """P -> S(d); backward: all-gather S(d) -> R of the same variant."""
    return with_adjoint("reduce_scatter", x, span, variant)
