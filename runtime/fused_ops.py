"""A linear fused with the collective feeding it or fed by it (CommFuse), as autograd
functions whose backward is the fused adjoint (runtime.collectives.fused for the kernels).

`y = x W^T + b` over the last dim; the chunks are the rows of dim `span.dim` of x (a batch or
token dim, kept in y at the same place), member j's L_j rows (uneven, possibly 0).

AGLinear (instruction ag_matmul): x held S(d), gathered to R under the matmul.
    forward    (y, x_full), y = linear(x_full) chunk by chunk, own chunk first
    backward   given dy and dx_other (the gradient later readers of x_full add):
               dx_j = dy_j W + dx_other_j, reduce-scattered by the matmul_rs ring (the
               adjoint of the gather), own chunk last; dW = dy^T x_full, db = sum dy (local)
LinearRS (instruction matmul_rs): x holds this rank's slice of the contraction, y = the sum over
the group of x W^T, reduce-scattered to this rank's rows, plus the bias (once, after the sum).
    backward   dy_j gathered by the ag_matmul ring, own chunk first; as chunk j arrives,
               dx[rows of j] = dy_j W and dW += dy_j^T x[rows of j]; db = sum of the local dy
               (the parameter's gradient sync adds the members')

Variants: ring (CommFuse), sliced2 / sliced4 (k-slicing, one collective per slice). The
backward uses the variant of the forward.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from hetsynth.instruction_set.kinds import fused_slices
from hetsynth.instruction_set.program import FUSED_MATMULS
from hetsynth.runtime.collectives import fused as K
from hetsynth.runtime.collectives.span import Span, from_front, to_front


def gather_compute(x: torch.Tensor, span: Span, variant: str, compute: K.Compute, y: torch.Tensor) -> torch.Tensor:
    """The gathered x; y written by compute, chunk by chunk."""
    k = fused_slices(variant)
    return K.ag_matmul_ring(x, span, compute, y) if k == 0 else K.ag_matmul_sliced(x, span, compute, k, y)


def compute_scatter(span: Span, variant: str, part_rows: Callable[[int, int, int], torch.Tensor]) -> torch.Tensor:
    k = fused_slices(variant)
    if k == 0:
        return K.matmul_rs_ring(span, lambda j: part_rows(j, 0, span.lengths[j]))
    return K.matmul_rs_sliced(span, part_rows, k)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(rows, last dim): every dim but the last flattened (a last dim of 0 allowed)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def matmul_into(rows: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor) -> None:
    """out = rows w (+ b) over the last dim, written in place (out: contiguous rows of the
    caller's output; a contiguous view keeps its storage through the reshape)."""
    if not out.is_contiguous():  # a reshape would copy, and the result be lost
        raise ValueError(f"matmul_into writes into contiguous rows only, got strides {out.stride()}")
    flat = _flat(out)
    if b is None:
        torch.mm(_flat(rows), w, out=flat)
    else:
        torch.addmm(b, _flat(rows), w, out=flat)


class AGLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, span: Span,
                variant: str) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        xf = to_front(x, span.dim)
        y = xf.new_empty(sum(span.lengths), *xf.shape[1:-1], w.shape[0])
        full = gather_compute(xf, span, variant, lambda j, s, rows, out: matmul_into(rows, w.t(), b, out), y)
        ctx.save_for_backward(full, w)
        ctx.span, ctx.variant, ctx.bias = span, variant, b is not None
        return from_front(y, span.dim), from_front(full, span.dim)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor | None, dx_other: torch.Tensor | None) -> tuple:
        full, w = ctx.saved_tensors
        span = ctx.span
        dy_f = to_front(dy, span.dim) if dy is not None else full.new_zeros(*full.shape[:-1], w.shape[0])
        other = to_front(dx_other, span.dim) if dx_other is not None else None
        offsets = span.offsets

        def part_rows(j: int, start: int, n: int) -> torch.Tensor:
            out = dy_f.narrow(0, offsets[j] + start, n) @ w
            return out if other is None else out.add_(other.narrow(0, offsets[j] + start, n))

        dx = from_front(compute_scatter(span, ctx.variant, part_rows), span.dim)
        dw = _flat(dy_f).t() @ _flat(full)
        db = _flat(dy_f).sum(0) if ctx.bias else None
        return dx, dw, db, None, None


class LinearRS(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, span: Span,
                variant: str) -> torch.Tensor:
        xf = to_front(x, span.dim)
        offsets = span.offsets
        y = compute_scatter(span, variant, lambda j, s, n: F.linear(xf.narrow(0, offsets[j] + s, n), w))
        ctx.save_for_backward(x, w)  # not xf: to_front copies a non-contiguous x, which would be a
        # second saved copy of a tensor its producer usually saves already (SDPA's output: 0.19 MiB a block, measured)
        ctx.span, ctx.variant, ctx.bias = span, variant, b is not None
        y = from_front(y, span.dim)
        return y + b if b is not None else y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        x, w = ctx.saved_tensors
        span = ctx.span
        xf, offsets = to_front(x, span.dim), span.offsets
        dw = torch.zeros_like(w)

        def compute(j: int, start: int, rows: torch.Tensor, out: torch.Tensor) -> None:
            dw.add_(_flat(rows).t() @ _flat(xf.narrow(0, offsets[j] + start, rows.shape[0])))
            matmul_into(rows, w, None, out)

        dy_f = to_front(dy, span.dim)
        dx = dy_f.new_empty(sum(span.lengths), *dy_f.shape[1:-1], w.shape[1])
        gather_compute(dy_f, span, ctx.variant, compute, dx)
        db = _flat(dy_f).sum(0) if ctx.bias else None
        return from_front(dx, span.dim), dw, db, None, None


class FusedLinear(nn.Module):
    """One fused instruction of a rank's program: `ag_matmul` returns (y, x_full), `matmul_rs`
    returns y (module docstring)."""

    def __init__(self, kind: str, span: Span, variant: str) -> None:
        super().__init__()
        assert kind in FUSED_MATMULS, kind
        self.kind, self.span, self.variant = kind, span, variant
        self.wire: torch.dtype | None = None  # the dtype its collective carries under autocast (codegen)

    def forward(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> Any:
        fn = AGLinear if self.kind == "ag_matmul" else LinearRS
        if not torch.is_autocast_enabled(x.device.type):
            return fn.apply(x, w, b, self.span, self.variant)
        # Under autocast (runtime.mixed_precision) the ring and its hand-written backward run
        # in one dtype on every rank, the wire's (the weight's when there is none): autocast's
        # cast of the weight, made here, and the activation's.
        dtype = self.wire or w.dtype
        with torch.autocast(x.device.type, enabled=False):
            return fn.apply(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype), self.span, self.variant)

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.span.describe()}, variant={self.variant}"
