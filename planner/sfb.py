"""Sufficient-factor broadcasting (Xie et al., "Lighter-communication distributed machine
learning via sufficient factor broadcasting", UAI 2016; HAP, EuroSys'24).

For `y = x W^T + b` with x split over tokens, the weight gradient is `dW = dy^T x`, a sum of
per-token outer products. Instead of all-reducing dW (out * in values), every device
all-gathers the factors x (tokens * in) and dy (tokens * out) and rebuilds the full dW itself:

    cost = all_gather(x) + all_gather(dy)                       (no adjoint: backward only)
         + 2 * tokens * in * out / throughput_i                 (rebuild, on every device)
         - 2 * tokens_i * in * out / throughput_i               (the local dW it replaces)

It pays when tokens < 2 * in * out / (in + out) and the rebuild is cheap next to the wire;
slow devices pay the full rebuild too, which the per-device cost charges.
"""

from __future__ import annotations

from typing import Sequence

from hetsynth.cost_models.compute import flops_cost
from hetsynth.cost_models.linear_cost import LinearCost
from hetsynth.planner.problem import Problem


def sfb_cost(pb: Problem, weight: str, linear: str, variant: str, shares: Sequence[float]) -> LinearCost:
    """LinearCost (in the shares of the linear's input x, linearised at `shares`) of SFB for
    `weight` used by `linear`."""
    x = pb.graph.node(linear).inputs[0]
    out_f, in_f = pb.meta(weight).shape
    tokens = pb.meta(x).numel // in_f
    scale = pb.graph.grad_reduce_scale  # the factors travel as the gradients would (runtime.sfb)
    gather = (pb.comm.cost("all_gather", variant, pb.meta(x).nbytes * scale, at=shares)
              + pb.comm.cost("all_gather", variant, pb.meta(linear).nbytes * scale, at=shares))
    flops = 2.0 * tokens * in_f * out_f
    rebuild = flops_cost(flops, pb.kinds, sharded=False) + flops_cost(flops, pb.kinds, sharded=True).scaled(-1.0)
    return gather + rebuild
