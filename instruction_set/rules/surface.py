"""The op surface: every op a captured graph can hold, and how each is sharded.

planner.lower lowers an exported model to torch's core ATen opset (the ops tagged
`torch.Tag.core`) plus the composites it keeps whole, `aten.detach` and the buffer update
`aten.copy_`. `classify(op)` says for each of them:

- `rule`              a sharding rule (instruction_set.rules: by name, or the pointwise tag rule)
- `replicated: why`   computed whole on every rank, for the reason given (rules.replicated_only)
- `decomposed: how`   replaced by primitive ops before planning (planner.decompose*)
- `not in forward: why`  cannot occur in a captured forward graph

Anything else (custom ops, higher-order control flow) is outside the surface: capture lists
it as unsupported, with its places.
"""

from __future__ import annotations

import torch

from hetsynth.instruction_set.rules.registry import is_supported
from hetsynth.instruction_set.rules.replicated_only import REASONS

DECOMPOSED = {
    "aten._native_batch_norm_legit_functional.default": "batch norm (training): means, all-reduced when batch-split",
    "aten._native_batch_norm_legit.no_stats": "batch norm without running statistics: as above",
    "aten._native_batch_norm_legit_no_training.default": "batch norm (evaluation): pointwise",
    "aten._native_batch_norm_legit.default": "functionalised into the _functional form",
    "aten.native_group_norm.default": "group norm: means over each sample's groups",
    "aten.cross_entropy_loss.default": "cross-entropy: amax, exp, sum, log, gather (vocab-parallel capable)",
}

_BACKWARD = "a backward kernel: backward passes come from autograd on the rank programs"
_SYMBOLIC = "a symbolic-shape query: captured shapes are concrete"
NOT_IN_FORWARD = {
    "aten._adaptive_avg_pool2d_backward.default": _BACKWARD, "aten.avg_pool2d_backward.default": _BACKWARD,
    "aten.convolution_backward.default": _BACKWARD, "aten.embedding_dense_backward.default": _BACKWARD,
    "aten.max_pool2d_with_indices_backward.default": _BACKWARD,
    "aten.native_group_norm_backward.default": _BACKWARD, "aten.native_layer_norm_backward.default": _BACKWARD,
    "aten.sym_is_contiguous.default": _SYMBOLIC, "aten.sym_numel.default": _SYMBOLIC,
    "aten.sym_size.int": _SYMBOLIC, "aten.sym_storage_offset.default": _SYMBOLIC,
    "aten.sym_stride.int": _SYMBOLIC,
    "aten.resize_.default": "in place: the lowering is functional",
}


def core_ops() -> list[str]:
    """Every overload of an aten op tagged core in this torch."""
    out = []
    for name in torch._C._dispatch_get_all_op_names():
        namespace, _, rest = name.partition("::")
        op_name, _, overload = rest.partition(".")
        packet = getattr(torch.ops.aten, op_name, None) if namespace == "aten" else None
        op = getattr(packet, overload or "default", None) if packet is not None else None
        if op is not None and torch.Tag.core in op.tags:
            out.append(str(op))
    return sorted(set(out))


def classify(op: str) -> str:
    """How `op` is handled (see the module docstring); '' when it is outside the surface."""
    if op in REASONS:
        return f"replicated: {REASONS[op]}"
    if op in DECOMPOSED:
        return f"decomposed: {DECOMPOSED[op]}"
    if op in NOT_IN_FORWARD:
        return f"not in forward: {NOT_IN_FORWARD[op]}"
    return "rule" if is_supported(op) else ""
