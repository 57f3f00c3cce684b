"""Conversions that need no communication.

slice    R -> S(d) along an axis: take this rank's rows [offset, offset + length) of dim d.
         Backward zero-pads the gradient to the full size: ranks' gradients sum to the whole,
         a Partial gradient, as the dual of R requires.
partial  R -> P: the keeper rank keeps the value, the others hold zeros; backward likewise.
         The zeros are x * 0, so that x's backward (and any collective in it) runs on every
         rank: a rank that skipped a collective would leave the others waiting.
"""

from __future__ import annotations

import torch


def slice_rows(x: torch.Tensor, dim: int, offset: int, length: int) -> torch.Tensor:
    """My rows, as a copy: a view saved for backward by the consumer would pin the whole
    replicated tensor until the backward (the memory model counts the rows; a copy of the
    rows costs a pass over them only). Both are differentiable (the backward scatters into
    zeros, the padding above)."""
    return x.narrow(dim, offset, length).clone()


def partial(x: torch.Tensor, keep: bool) -> torch.Tensor:
    return x if keep else x * 0
