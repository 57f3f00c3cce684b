"""Sufficient-factor broadcasting in the backward pass of a batch-split linear layer.

    forward   y = x W^T  (the bias, if any, is added outside, by autograd)
    backward  dx = dy W                        (local, as usual)
              dW = gather(dy)^T gather(x)      (every rank rebuilds the full weight gradient
                                                from all ranks' factors: no all-reduce of dW)

x and dy are flattened to [tokens, features]; `span` gives every rank's token count (uneven,
possibly 0) and the group. Because every rank computes the same full dW, the weight's
gradient is already replicated and needs no synchronisation (Xie et al., UAI 2016). Under a
policy that reduces gradients in bfloat16 (runtime.mixed_precision.gradient_wire) the factors,
this weight's gradient traffic, travel in bfloat16 and dW is formed from them in x's dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from hetsynth.runtime import collectives  # noqa: F401  (registers the variants)
from hetsynth.runtime.collectives.registry import COLLECTIVE_VARIANTS
from hetsynth.runtime.collectives.span import Span
from hetsynth.runtime.mixed_precision import reduced


class SFBLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, span: Span, variant: str,
                wire: torch.dtype | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.span, ctx.variant, ctx.wire = span, variant, wire
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        gather = COLLECTIVE_VARIANTS.get("all_gather", variant=ctx.variant)
        xs = reduced(lambda t: gather(t, ctx.span), x.reshape(-1, x.shape[-1]), ctx.wire)
        dys = reduced(lambda t: gather(t, ctx.span), dy.reshape(-1, dy.shape[-1]), ctx.wire)
        return dy @ weight, dys.t() @ xs, None, None, None


class SFBLinearModule(torch.nn.Module):
    """The linear op of a node whose weight synchronises by SFB."""

    def __init__(self, span: Span, variant: str, wire: torch.dtype | None = None) -> None:
        super().__init__()
        self.span, self.variant, self.wire = span, variant, wire  # wire: the factors' dtype (module docstring)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = SFBLinear.apply(x, weight, self.span, self.variant, self.wire)
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        return f"tokens={list(self.span.lengths)}, variant={self.variant}"
