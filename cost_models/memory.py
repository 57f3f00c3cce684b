"""Memory per device: parameters with their gradients and Adam state, and saved activations.

    memory_i = sum_params bytes_p * (1 param + 1 grad + 2 Adam moments) * s_p,i
             + sum_ops  bytes_out(op) * s_op,i        (outputs kept for the backward pass)
             + sum_sfb  gathered factor bytes          (full x and dy of SFB layers)

with s = 1 for replicated tensors and the device's share for sharded ones (Rajbhandari et
al., ZeRO, SC'20, count 16 bytes per parameter for mixed-precision Adam; we keep the model's
dtype for all four copies). Activations are the outputs of non-view ops through which a
gradient flows, an upper bound on what autograd saves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from cost_models.compute import FREE_OPS
from instruction_set.graph import Node

OPTIMIZER_COPIES = 4  # parameter, gradient, Adam exp_avg, Adam exp_avg_sq

GIB = 2.0**30


@dataclass(frozen=True, slots=True)
class MemoryTerm:
    """bytes on device i = fixed_i + per_share_i * s_i (same form as LinearCost, summed)."""

    fixed: tuple[float, ...]
    per_share: tuple[float, ...]

    def per_device(self, shares: Sequence[float]) -> list[float]:
        return [f + p * s for f, p, s in zip(self.fixed, self.per_share, shares)]


def param_memory(nbytes: float, sharded: bool, n: int) -> MemoryTerm:
    total = nbytes * OPTIMIZER_COPIES
    zeros = (0.0,) * n
    return MemoryTerm(zeros, (total,) * n) if sharded else MemoryTerm((total,) * n, zeros)


def activation_memory(node: Node, sharded: bool, n: int) -> MemoryTerm:
    zeros = (0.0,) * n
    if node.target in FREE_OPS or not any(o.requires_grad for o in node.outputs):
        return MemoryTerm(zeros, zeros)
    total = float(node.out_bytes)
    return MemoryTerm(zeros, (total,) * n) if sharded else MemoryTerm((total,) * n, zeros)
