"""Compute cost of one op of the reference graph on each device.

    time_i = launches * kernel_launch_us + max(flops / throughput_flops_i,
                                              bytes / memory_bandwidth_i)

for the forward and backward passes together: `flops` from FlopCounterMode (forward +
backward), `bytes` the op's inputs and outputs, read and written once forward and about
twice backward when a gradient flows (a roofline estimate: Williams et al., CACM 2009).
A sharded op does `share_i` of that work on device i; replicated work is done in full by every
device, the slow ones too. When the op was timed on a reference machine (profiling.op_profile)
the roofline is replaced by `measured_s * reference_flops / throughput_flops_i`, or by
`measured_s * device_scale_k` when the whole model was also timed on devices of kind k
(profiling.model_timing). Pure views (view, transpose, expand, ...) launch nothing and are free.

The optimizer step of a trained parameter is memory-bound work on every device that holds
it (its share when sharded, all of it when replicated):

    update_i = UPDATE_PASSES * param_bytes / memory_bandwidth_i

UPDATE_PASSES = 16 counts the passes over the parameter's bytes: the gradient bucket's
flatten and copy-back (4), the global-norm clipping's float64 square-sum and rescale (5), and
AdamW's reads of parameter, gradient and both moments and writes of three (7). A measured
update time (profiling.op_profile) replaces the estimate, scaled like the ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hetsynth.cost_models.linear_cost import LinearCost
from hetsynth.instruction_set.cluster import DeviceKind
from hetsynth.instruction_set.graph import Node, TensorMeta

FREE_OPS = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.transpose.int", "aten.permute.default",
    "aten.t.default", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
    "aten.squeeze.default", "aten.expand.default", "aten.select.int", "aten.slice.Tensor",
    "aten.split.Tensor", "aten.split_with_sizes.default", "getitem", "aten.alias.default",
    "aten.detach.default",
})


def op_bytes(node: Node, in_metas: Sequence[TensorMeta]) -> float:
    """Bytes moved by the op, forward plus (when a gradient flows) backward."""
    moved = sum(m.nbytes for m in in_metas) + node.out_bytes
    return moved * (3.0 if any(o.requires_grad for o in node.outputs) else 1.0)


def launches(node: Node) -> int:
    return 1 + (2 if any(o.requires_grad for o in node.outputs) else 0)


@dataclass(frozen=True)
class Reference:
    """The machine that timed the ops (profiling.op_profile), by its matmul FLOP/s, and per
    device the measured factor of the whole model there (profiling.model_timing), None where
    not measured. (Scaling memory-bound ops by a streaming-bandwidth ratio instead was tried:
    on this machine that kernel's rate varies threefold between processes with the
    last-level cache's state.)"""

    flops: float
    measured: tuple[float | None, ...] = ()

    def scales(self, kinds: Sequence[DeviceKind]) -> list[float]:
        """Per device: how much longer an op takes there than on the reference machine: the
        measured factor, else the ratio of matmul rates."""
        measured = self.measured or (None,) * len(kinds)
        return [m if m is not None else self.flops / k.throughput_flops for m, k in zip(measured, kinds, strict=True)]


def compute_cost(node: Node, in_metas: Sequence[TensorMeta], sharded: bool,
                 kinds: Sequence[DeviceKind], reference: Reference | None = None) -> LinearCost:
    """LinearCost of the op: per device, work scales with the share when `sharded`. With a
    measured time (profiling.op_profile), device i's work is that time scaled from the
    reference machine to device i (Reference.scales); else the roofline estimate."""
    n = len(kinds)
    if node.target in FREE_OPS:
        return LinearCost.zero(n)
    if node.measured_s is not None and reference is not None:
        work = [node.measured_s * x for x in reference.scales(kinds)]
    else:
        flops = node.flops_fwd + node.flops_bwd
        moved = op_bytes(node, in_metas)
        work = [max(flops / k.throughput_flops, moved / (k.memory_bandwidth_gbyte_s * 1e9)) for k in kinds]
    fixed = [launches(node) * k.kernel_launch_us * 1e-6 for k in kinds]
    return LinearCost.work(fixed, work, sharded=sharded)


UPDATE_PASSES = 16.0


def update_cost(node: Node, sharded: bool, kinds: Sequence[DeviceKind],
                measured: tuple[float, float] | None = None, reference: Reference | None = None) -> LinearCost:
    """LinearCost of the optimizer step of parameter `node` (zero when it is not trained).
    `measured` = (seconds per parameter, seconds per byte) on the reference machine."""
    n = len(kinds)
    if not node.out.requires_grad:
        return LinearCost.zero(n)
    if measured is not None and reference is not None:
        scale = reference.scales(kinds)
        fixed = tuple(measured[0] * x for x in scale)
        work = tuple(measured[1] * node.out.nbytes * x for x in scale)
    else:
        fixed = (0.0,) * n
        work = tuple(UPDATE_PASSES * node.out.nbytes / (k.memory_bandwidth_gbyte_s * 1e9) for k in kinds)
    return LinearCost.work(fixed, work, sharded=sharded)


def flops_cost(flops: float, kinds: Sequence[DeviceKind], sharded: bool) -> LinearCost:
    """Pure matmul work (used for sufficient-factor rebuilds)."""
    return LinearCost.work([0.0] * len(kinds), [flops / k.throughput_flops for k in kinds], sharded=sharded)
