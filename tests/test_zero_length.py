"""Every op the sharding rules accept runs on zero-length local shards, forward and backward.

The planner may give a device nothing (ratios are rounded to shard lengths by largest
remainder, and zero-length shards are legal). For every op of the rule surface (the ops
instruction_set.rules registers by name, and those of the surface its pointwise tag rule
covers) and every rule that shards a tensor, two ranks split the op's inputs 1:0 and 0:1: one
rank's shards are empty along whatever dim the rule splits (rows, columns, channels, the
dims an FFT does not transform, ...). Each rank runs its local computation
(instruction_set.local.emit_local, the code path of the runtime); the ranks' outputs must
combine to the single-device output, and the backward of a weighted sum of the outputs must
give every input its single-device gradient.

An op of the surface without a sample here fails the test (SAMPLES, or a sample built from an
elementwise op's schema), so an op gained later is covered or named.

The end-to-end test at the bottom plans a model with `torch.fft.rfft` on the emulated
4-device cluster with ratios that leave three devices no rows, and runs
`hetsynth run PLAN --check` on 4 ranks.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from hetsynth.instruction_set.args import decode_arg, encode_arg, refs_in
from hetsynth.instruction_set.graph import Node, TensorMeta
from hetsynth.instruction_set.interpret import resolve_target, run_target
from hetsynth.instruction_set.layouts import P, PMAX, R, Layout
from hetsynth.instruction_set.local import RANDOM_DRAWS, EagerBuilder, LocalContext, emit_local, local_kinds
from hetsynth.instruction_set.rules import Rule, registered_targets, rules_for
from hetsynth.instruction_set.rules.elementwise import ELEMENTWISE
from hetsynth.instruction_set.experts_op import dispatched_math
from hetsynth.runtime.experts import expert_starts
from thread_exchange import ThreadExchange, together

try:  # registers transformers' MoE custom op, so that the surface below holds it in every order of tests
    import transformers.integrations.moe  # noqa: F401
except ImportError:  # transformers is a dev dependency; without it the op is not loaded and not accepted
    pass
from hetsynth.instruction_set.rules.registry import _rule_fn, replicated
from hetsynth.instruction_set.rules.surface import classify, core_ops
from hetsynth.planner.lower import KEEP

Sample = tuple[tuple, dict]


class Outputs(tuple):
    """An input that is a multi-output op's result (what getitem reads)."""


def T(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def U(*shape: int) -> torch.Tensor:
    """Values in (0.2, 0.8): inside every pointwise op's domain."""
    return torch.rand(*shape, dtype=torch.float64) * 0.6 + 0.2


def C(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.complex128)


def I(*shape: int, high: int) -> torch.Tensor:
    return torch.randint(0, high, shape)


def B(*shape: int) -> torch.Tensor:
    return torch.rand(*shape) > 0.5


def distinct(rows: int, cols: int, high: int) -> torch.Tensor:
    """Indices without repeats in a row (scatter with repeats keeps an arbitrary one)."""
    return torch.stack([torch.randperm(high)[:cols] for _ in range(rows)])


def s(*args: Any, **kwargs: Any) -> Sample:
    return args, kwargs


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal up to float64 rounding (float32 ops, such as grouped_mm, to float32's)."""
    tight = want.dtype in (torch.float64, torch.complex128)
    torch.testing.assert_close(got, want, equal_nan=True, msg=lambda m: f"{what}: {m}",
                               **({"rtol": 1e-9, "atol": 1e-9} if tight else {}))


SAMPLES: dict[str, Callable[[], list[Sample]]] = {
    "aten._adaptive_avg_pool2d.default": lambda: [s(T(2, 3, 4, 4), [2, 2])],
    "aten._adaptive_avg_pool3d.default": lambda: [s(T(2, 3, 4, 4, 4), [2, 2, 2])],
    "aten._fft_c2c.default": lambda: [s(C(2, 4, 6), [1], 0, True)],
    "aten._fft_c2r.default": lambda: [s(C(2, 4, 3), [1], 0, 6)],
    "aten._fft_r2c.default": lambda: [s(T(2, 6, 4), [1], 0, True), s(T(3, 6), [1], 2, True)],
    "aten._grouped_mm.default": lambda: [s(T(6, 8).float(), T(2, 8, 4).float(),  # float32: no float64 kernel
                                           torch.tensor([2, 6], dtype=torch.int32))],
    "transformers.grouped_mm_fallback.default": lambda: [s(T(6, 8), T(2, 8, 4), torch.tensor([2, 6], dtype=torch.int32))],
    "aten._log_softmax.default": lambda: [s(T(4, 6), 1, False)],
    "aten._softmax.default": lambda: [s(T(4, 6), 1, False)],
    "aten._to_copy.default": lambda: [s(T(4, 6), dtype=torch.float32)],
    "aten._unsafe_view.default": lambda: [s(T(4, 6), [4, 2, 3])],
    "aten.acosh.default": lambda: [s(U(4, 6) + 1)],
    "aten.adaptive_avg_pool1d.default": lambda: [s(T(2, 3, 8), [4])],
    "aten.adaptive_avg_pool2d.default": lambda: [s(T(2, 3, 4, 4), [2, 2])],
    "aten.addmm.default": lambda: [s(T(3), T(4, 5), T(5, 3))],
    "aten.amax.default": lambda: [s(T(4, 6), [1]), s(T(4, 6), [0, 1], True)],
    "aten.amin.default": lambda: [s(T(4, 6), [1])],
    "aten.any.dim": lambda: [s(B(4, 6), 1)],
    "aten.any.dims": lambda: [s(B(4, 6), [1])],
    "aten.argmax.default": lambda: [s(T(4, 6), 1)],
    "aten.argmin.default": lambda: [s(T(4, 6), 1)],
    "aten.avg_pool1d.default": lambda: [s(T(2, 3, 8), [2])],
    "aten.avg_pool2d.default": lambda: [s(T(2, 3, 4, 4), [2, 2])],
    "aten.avg_pool3d.default": lambda: [s(T(2, 3, 4, 4, 4), [2, 2, 2])],
    "aten.bernoulli.p": lambda: [s(U(4, 6), 0.5)],
    "aten.bmm.default": lambda: [s(T(2, 3, 4), T(2, 4, 5))],
    "aten.cat.default": lambda: [s([T(2, 3), T(4, 3)], 0), s([T(3, 2), T(3, 4)], 1)],
    "aten.clamp.Tensor": lambda: [s(U(4, 6), U(4, 6) * 0.5, U(4, 6) + 0.3)],
    "aten.clamp.default": lambda: [s(U(4, 6), 0.3, 0.6)],
    "aten.constant_pad_nd.default": lambda: [s(T(2, 3, 4), [1, 1])],
    "aten.contiguous.default": lambda: [s(T(4, 6))],
    "aten.convolution.default": lambda: [
        s(T(2, 3, 5, 5), T(4, 3, 3, 3), T(4), [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
        s(T(2, 4, 3, 3), T(4, 2, 2, 2), T(2), [2, 2], [0, 0], [1, 1], True, [0, 0], 1)],
    "aten.copy.default": lambda: [s(T(4, 6), T(4, 6))],
    "aten.cumsum.default": lambda: [s(T(4, 6), 1)],
    "aten.div.Scalar_mode": lambda: [s(T(4, 6), 0.3, rounding_mode="floor")],
    "aten.div.Tensor_mode": lambda: [s(T(4, 6), U(4, 6), rounding_mode="trunc")],
    "aten.dropout.default": lambda: [s(T(4, 6), 0.5, True)],
    "aten.einsum.default": lambda: [s("bij,bjk->bik", [T(2, 3, 4), T(2, 4, 5)])],
    "aten.embedding.default": lambda: [s(T(7, 4), I(3, 5, high=7))],
    "aten.empty_like.default": lambda: [s(T(4, 6))],
    "aten.expand.default": lambda: [s(T(4, 1), [4, 6])],
    "aten.fill.Scalar": lambda: [s(T(4, 6), 2.0)],
    "aten.flatten.using_ints": lambda: [s(T(2, 3, 4), 1, 2)],
    "aten.flip.default": lambda: [s(T(4, 6), [1])],
    "aten.polar.default": lambda: [s(U(4, 6), T(4, 6))],
    "aten.view_as_complex.default": lambda: [s(T(4, 6, 2))],
    "aten.view_as_real.default": lambda: [s(C(4, 6))],
    "aten.full_like.default": lambda: [s(T(4, 6), 2.0)],
    "aten.gather.default": lambda: [s(T(4, 6), 1, I(4, 3, high=6))],
    "aten.grid_sampler_2d.default": lambda: [s(T(2, 3, 4, 4), U(2, 3, 3, 2) * 2 - 1, 0, 0, False)],
    "aten.histc.default": lambda: [s(U(4, 6), 5, 0.0, 1.0)],
    "hetsynth.routed_experts.default": lambda: [s(T(6, 4), distinct(6, 2, 4), U(6, 2), T(4, 6, 4), T(4, 4, 3), "silu", 0)],
    "aten.index.Tensor": lambda: [s(T(4, 6), [I(3, high=4)]), s(T(4, 6), [None, I(2, high=6)])],
    "aten.index_select.default": lambda: [s(T(4, 6), 1, I(3, high=6))],
    "aten.layer_norm.default": lambda: [s(T(4, 6), [6], T(6), T(6))],
    "aten.lift_fresh_copy.default": lambda: [s(T(4, 6))],
    "aten.linear.default": lambda: [s(T(4, 5), T(3, 5), T(3))],
    "aten.log_softmax.int": lambda: [s(T(4, 6), 1)],
    "aten.masked_fill.Tensor": lambda: [s(T(4, 6), B(4, 6), torch.tensor(0.5, dtype=torch.float64))],
    "aten.matmul.default": lambda: [s(T(2, 3, 4), T(4, 5))],
    "aten.max.dim": lambda: [s(T(4, 6), 1)],
    "aten.max_pool1d.default": lambda: [s(T(2, 3, 8), [2])],
    "aten.max_pool2d.default": lambda: [s(T(2, 3, 4, 4), [2, 2])],
    "aten.max_pool2d_with_indices.default": lambda: [s(T(2, 3, 4, 4), [2, 2])],
    "aten.max_pool3d_with_indices.default": lambda: [s(T(2, 3, 4, 4, 4), [2, 2, 2])],
    "aten.mean.default": lambda: [s(T(4, 6))],
    "aten.mean.dim": lambda: [s(T(4, 6), [1]), s(T(2, 3, 4), [0, 2], True)],
    "aten.min.dim": lambda: [s(T(4, 6), 1)],
    "aten.mm.default": lambda: [s(T(4, 5), T(5, 3))],
    "aten.native_dropout.default": lambda: [s(T(4, 6), 0.5, True)],
    "aten.native_layer_norm.default": lambda: [s(T(4, 6), [6], T(6), T(6), 1e-5)],
    "aten.one_hot.default": lambda: [s(I(4, 3, high=5), 5)],
    "aten.ones_like.default": lambda: [s(T(4, 6))],
    "aten.pad.default": lambda: [s(T(2, 3, 4), [1, 1])],
    "aten.permute.default": lambda: [s(T(2, 3, 4), [2, 0, 1])],
    "aten.pow.Scalar": lambda: [s(2.0, U(4, 6))],
    "aten.prod.default": lambda: [s(U(4, 6) + 0.5)],
    "aten.prod.dim_int": lambda: [s(U(4, 6) + 0.5, 1)],
    "aten.rand_like.default": lambda: [s(T(4, 6))],
    "aten.randn_like.default": lambda: [s(T(4, 6))],
    "aten.reflection_pad1d.default": lambda: [s(T(2, 3, 5), [1, 1])],
    "aten.reflection_pad2d.default": lambda: [s(T(2, 3, 4, 4), [1, 1, 1, 1])],
    "aten.reflection_pad3d.default": lambda: [s(T(2, 3, 4, 4, 4), [1] * 6)],
    "aten.repeat.default": lambda: [s(T(2, 3), [2, 1])],
    "aten.replication_pad1d.default": lambda: [s(T(2, 3, 5), [1, 1])],
    "aten.replication_pad2d.default": lambda: [s(T(2, 3, 4, 4), [1, 1, 1, 1])],
    "aten.replication_pad3d.default": lambda: [s(T(2, 3, 4, 4, 4), [1] * 6)],
    "aten.reshape.default": lambda: [s(T(4, 6), [4, 2, 3])],
    "aten.rms_norm.default": lambda: [s(T(4, 6), [6], T(6), 1e-5)],
    "aten.scaled_dot_product_attention.default": lambda: [s(T(2, 2, 4, 3), T(2, 2, 4, 3), T(2, 2, 4, 3),
                                                            is_causal=True)],
    "aten.scatter.src": lambda: [s(T(4, 6), 1, distinct(4, 2, 6), T(4, 2))],
    "aten.scatter.value": lambda: [s(T(4, 6), 1, distinct(4, 2, 6), 2.0)],
    "aten.scatter_add.default": lambda: [s(T(4, 6), 1, I(4, 2, high=6), T(4, 2))],
    "aten.scatter_reduce.two": lambda: [s(T(4, 6), 1, I(4, 2, high=6), T(4, 2), "sum")],
    "aten.select.int": lambda: [s(T(4, 6), 1, 2)],
    "aten.select_scatter.default": lambda: [s(T(4, 6), T(4), 1, 2)],
    "aten.slice.Tensor": lambda: [s(T(4, 6), 1, 1, 5)],
    "aten.slice_scatter.default": lambda: [s(T(4, 6), T(4, 4), 1, 1, 5)],
    "aten.softmax.int": lambda: [s(T(4, 6), 1)],
    "aten.sort.default": lambda: [s(T(4, 6), 1)],
    "aten.split.Tensor": lambda: [s(T(4, 6), 2, 1)],
    "aten.split_with_sizes.default": lambda: [s(T(4, 6), [2, 4], 1)],
    "aten.squeeze.default": lambda: [s(T(4, 1, 6))],
    "aten.squeeze.dim": lambda: [s(T(4, 1, 6), 1)],
    "aten.squeeze.dims": lambda: [s(T(4, 1, 6), [1])],
    "aten.stack.default": lambda: [s([T(4, 6), T(4, 6)], 1)],
    "aten.sum.default": lambda: [s(T(4, 6))],
    "aten.sum.dim_IntList": lambda: [s(T(4, 6), [1])],
    "aten.t.default": lambda: [s(T(4, 6))],
    "aten.to.dtype": lambda: [s(T(4, 6), torch.float32)],
    "aten.to.dtype_layout": lambda: [s(T(4, 6), dtype=torch.float32)],
    "aten.topk.default": lambda: [s(T(4, 6), 2, 1)],
    "aten.transpose.int": lambda: [s(T(2, 3, 4), 0, 2)],
    "aten.type_as.default": lambda: [s(T(4, 6), T(4, 6).float())],
    "aten.unsqueeze.default": lambda: [s(T(4, 6), 1)],
    "aten.upsample_bilinear2d.vec": lambda: [s(T(2, 3, 4, 4), None, False, [2.0, 2.0])],
    "aten.upsample_nearest2d.vec": lambda: [s(T(2, 3, 4, 4), None, [2.0, 2.0])],
    "aten.var.correction": lambda: [s(T(4, 6), [1], correction=1)],
    "aten.var.dim": lambda: [s(T(4, 6), [1], True)],
    "aten.view.default": lambda: [s(T(4, 6), [4, 2, 3]), s(T(2, 3, 4), [6, 4])],
    "aten.where.self": lambda: [s(B(4, 6), T(4, 6), T(4, 6))],
    "aten.zeros_like.default": lambda: [s(T(4, 6))],
    "getitem": lambda: [s(Outputs((T(4, 6), T(4, 6))), 1)],
}

# Ops of the surface that no rank program computes.
NOT_RUN = {"aten.copy_.default": "the buffer update: the trainer writes it after the backward pass",
           "aten.atan2.out": "an out= variant (tagged pointwise): a functional graph never holds it"}

# Ops of the surface that no rule shards: every rank computes them whole.
UNSHARDED = {"aten.prod.default": "a product of every element: no dim kept, and not linear"}

# Ops whose values are not the single-device ones (uninitialised memory): only the shapes and
# the backward are checked. Random draws are compared: each rank and the reference draw from
# the same generator state (instruction_set.local.draw_whole).
UNCOMPARED = {"aten.empty_like.default"}
SEED = 1234


def accepted_ops() -> list[str]:
    """Every op a captured graph may hold that has a sharding rule (replicated-only ops are
    computed whole on every rank: no shard of theirs is ever empty), and whose library is
    loaded (a custom op of a package this process has not imported cannot run)."""
    surface = core_ops() + [str(op) for op in KEEP] + ["aten.copy_.default"]
    ops = {op for op in surface if classify(op) == "rule"} | set(registered_targets())
    return sorted(op for op in ops if _rule_fn(op) is not replicated and loaded(op))


def loaded(target: str) -> bool:
    try:
        resolve_target(target)
    except AttributeError:
        return False
    return True


def elementwise_sample(target: str) -> list[Sample] | None:
    """A sample from an elementwise op's schema (pointwise-tagged, or in ELEMENTWISE): its
    tensors (4, 6) in (0.2, 0.8) (integers for bitwise ops), its scalars 0.5 (3), its
    defaulted arguments left out; None when the schema has anything else."""
    op = resolve_target(target)
    if torch.Tag.pointwise not in op.tags and target not in ELEMENTWISE:
        return None
    integer = "bitwise" in target
    args: list[Any] = []
    for a in op._schema.arguments:
        if a.has_default_value():
            continue
        kind = str(a.type)
        if a.kwarg_only or kind not in ("Tensor", "number"):
            return None
        args.append((I(4, 6, high=16) if integer else U(4, 6)) if kind == "Tensor" else (3 if integer else 0.5))
    return [s(*args)]


def samples(target: str) -> list[Sample] | None:
    return SAMPLES[target]() if target in SAMPLES else elementwise_sample(target)


# -- the op as a reference-graph node --------------------------------------------------------------

def make_node(target: str, sample: Sample) -> tuple[Node, dict[str, Any]]:
    """(the node, its input values by name)."""
    values: dict[str, Any] = {}

    def name_of(v: Any) -> str | None:
        if isinstance(v, (torch.Tensor, Outputs)):
            values[f"in{len(values)}"] = v
            return f"in{len(values) - 1}"
        return None

    args = [encode_arg(a, name_of) for a in sample[0]]
    kwargs = {k: encode_arg(v, name_of) for k, v in sample[1].items()}
    out = run_target(target)(*sample[0], **sample[1])
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    node = Node(name="op", op="call", target=target, args=tuple(args), kwargs=kwargs,
                inputs=tuple(refs_in(args) + [r for v in kwargs.values() for r in refs_in(v)]),
                outputs=tuple(meta(t) for t in outs), multi_output=isinstance(out, (tuple, list)))
    return node, values


def meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."),
                      requires_grad=t.is_floating_point())


def first(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, tuple) else value


# -- two ranks, one of them empty -------------------------------------------------------------------

def lengths(size: int, empty: int) -> list[int]:
    return [size, 0] if empty == 1 else [0, size]


def split(value: Any, layout: Layout, empty: int, g: torch.Generator) -> list[Any]:
    """The value on ranks 0 and 1 (rank `empty` holds zero-length shards)."""
    if isinstance(value, tuple):
        return [Outputs(parts) for parts in zip(*[split(v, layout, empty, g) for v in value])]
    if layout == R:
        return [value, value]
    if layout == P:
        if not (value.is_floating_point() or value.is_complex()):
            return [torch.zeros_like(value), value]
        part = torch.randn(value.shape, generator=g, dtype=value.dtype)
        return [part, value - part]
    d = layout.shard_dim
    return list(torch.split(value, lengths(value.shape[d], empty), dim=d))


def leaves(parts: list[Any], grad: bool = True) -> list[Any]:
    """Fresh leaf tensors (floating ones requiring grad, if `grad`) in place of each rank's values."""
    def leaf(t: Any) -> Any:
        if isinstance(t, Outputs):
            return Outputs(leaf(v) for v in t)
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach().clone().requires_grad_(grad and (t.is_floating_point() or t.is_complex()))
    return [leaf(p) for p in parts]


def differentiable(node: Node, values: dict[str, Any]) -> bool:
    """Whether the op has a backward (aten.copy and bernoulli have none: forward only)."""
    whole = {n: leaves([v])[0] for n, v in values.items()}
    outs = flat(reference(node, whole))
    try:
        grads(weighted(outs, out_weights(outs, torch.Generator())), [float_leaves(v) for v in whole.values()])
    except RuntimeError as err:
        if "derivative for" in str(err) and "not implemented" in str(err):
            return False
        raise
    return True


def flat(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def run_rank(node: Node, rule: Rule, rank: int, empty: int, inputs: list[Any], whole: dict[str, Any],
             hub: ThreadExchange | None = None) -> Any:
    if "experts_dispatched" in local_kinds(rule.local):  # rows exchanged between the ranks (runtime.experts)
        starts = expert_starts(lengths(first(whole[node.inputs[3]]).shape[0], empty))
        return dispatched_math(*inputs[:5], node.args[5], starts, rank, hub.member(rank))
    shapes = []
    for m in node.outputs:
        shape = list(m.shape)
        if rule.output.shard_dim is not None:
            shape[rule.output.shard_dim] = lengths(shape[rule.output.shard_dim], empty)[rank]
        shapes.append(tuple(shape))
    dropped = frozenset(int(p.split(":")[1].split("@")[0]) for p in rule.local.split(",")
                        if p.startswith("once:")) if rank != 0 else frozenset()
    offsets = {}
    if local_kinds(rule.local) & {"gather_sharded", "embedding_sharded"}:
        full = first(whole[node.inputs[0]])
        offsets[0] = sum(lengths(full.shape[rule.inputs[0].shard_dim], empty)[:rank])
    if "experts_sharded" in local_kinds(rule.local):  # the rank's first expert
        offsets[3] = sum(lengths(first(whole[node.inputs[3]]).shape[0], empty)[:rank])
    starts = {}
    if node.target in RANDOM_DRAWS and rule.output.shard_dim is not None:  # the rank's window of a whole draw
        d = rule.output.shard_dim
        starts[d] = sum(lengths(node.outputs[0].shape[d], empty)[:rank])
        torch.manual_seed(SEED)  # each rank's generator as one device's (every rank draws whole)
    ctx = LocalContext(tuple(shapes), dropped=dropped, offsets=offsets, global_count=mean_count(node, whole),
                       starts=starts)
    return emit_local(node, rule.local, inputs, ctx, EagerBuilder())


def mean_count(node: Node, whole: dict[str, Any]) -> int:
    if "mean" not in node.target:
        return 1
    x = first(whole[node.inputs[0]])
    dims = node.args[1] if len(node.args) > 1 and node.args[1] else list(range(x.dim()))
    return math.prod(x.shape[d % x.dim()] for d in dims)


def combine(parts: list[Any], layout: Layout) -> Any:
    if isinstance(parts[0], (tuple, list)):
        return [combine([p[i] for p in parts], layout) for i in range(len(parts[0]))]
    if layout == P:
        return parts[0] + parts[1]
    if layout == PMAX:
        return torch.maximum(parts[0], parts[1])
    if layout == R:
        close(parts[1], parts[0], "an R output differs between the ranks")
        return parts[0]
    return torch.cat(parts, dim=layout.shard_dim)


def weighted(outs: list[Any], weights: list[torch.Tensor]) -> torch.Tensor | None:
    """sum_k <w_k, out_k> over the differentiable outputs (complex ones as real pairs)."""
    terms = [(o.real * w[..., 0] + o.imag * w[..., 1] if o.is_complex() else o * w).sum()
             for o, w in zip(outs, weights) if isinstance(o, torch.Tensor) and o.requires_grad]
    return sum(terms) if terms else None


def out_weights(outs: list[Any], g: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn((*o.shape, 2) if o.is_complex() else o.shape, generator=g,
                        dtype=torch.float64) if isinstance(o, torch.Tensor) else None for o in outs]


def rank_weights(weights: list[torch.Tensor], layout: Layout, rank: int, empty: int) -> list[torch.Tensor]:
    """Each rank's share of the output weights: its shard of an S output, all of a P one, half
    of an R one (both ranks hold it)."""
    if layout == R:
        return [None if w is None else w / 2 for w in weights]
    if layout.shard_dim is None:
        return weights
    d = layout.shard_dim
    return [None if w is None else w.split(lengths(w.shape[d], empty), dim=d)[rank] for w in weights]


def grads(loss: torch.Tensor | None, tensors: list[list[torch.Tensor]]) -> list[list[torch.Tensor | None]]:
    """d loss / d each tensor, grouped as `tensors` is (None where nothing is differentiable)."""
    every = [t for group in tensors for t in group]
    if loss is None or not loss.requires_grad or not every:
        return [[None] * len(group) for group in tensors]
    got = iter(torch.autograd.grad(loss, every, allow_unused=True))
    return [[torch.zeros_like(t) if (d := next(got)) is None else d for t in group] for group in tensors]


def float_leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in flat(value) if isinstance(t, torch.Tensor) and t.requires_grad]


def check_rule(target: str, node: Node, values: dict[str, Any], rule: Rule, empty: int, g: torch.Generator) -> None:
    where = f"{target} rule {rule.inputs}->{rule.output} {rule.local!r}, rank {empty} empty"
    whole = {n: leaves([v], differentiable(node, values))[0] for n, v in values.items()}
    per_input = [leaves(split(whole[t], layout, empty, g), differentiable(node, values))
                 for t, layout in zip(node.inputs, rule.inputs)]
    hub = ThreadExchange(2) if "experts_dispatched" in local_kinds(rule.local) else None
    ranks = both(lambda r: run_rank(node, rule, r, empty, [p[r] for p in per_input], whole, hub), hub)
    want = reference(node, whole)
    if target not in UNCOMPARED:
        got = combine(ranks, rule.output)
        for o, w in zip(flat(got), flat(want)):
            close(o, w, where)
    weights = out_weights(flat(want), g)
    expected = grads(weighted(flat(want), weights), [float_leaves(whole[t]) for t in node.inputs])
    got_grads = list(zip(*both(lambda r: grads(weighted(flat(ranks[r]), rank_weights(weights, rule.output, r, empty)),
                                               [float_leaves(p[r]) for p in per_input]), hub)))
    if target in UNCOMPARED or rule.output == PMAX:
        return  # the backward ran; a max across ranks sends its gradient to one rank
    for i, layout in enumerate(rule.inputs):
        for k, want_grad in enumerate(expected[i]):
            if want_grad is None:
                continue
            parts = [got_grads[i][r][k] for r in (0, 1)]
            assert all(p is not None for p in parts), (
                f"{where}: input {i} is not in the autograd graph of rank {parts.index(None)}'s output "
                "(the collectives of its backward would not run on that rank)")
            if layout == P:
                for part in parts:
                    close(part, want_grad, f"{where}, gradient of input {i}")
                continue
            joined = parts[0] + parts[1] if layout == R else torch.cat(parts, dim=layout.shard_dim)
            close(joined, want_grad, f"{where}, gradient of input {i}")


def both(call: Callable[[int], Any], hub: ThreadExchange | None) -> list[Any]:
    """call(0), call(1): one after the other, or at once where the ranks exchange rows."""
    if hub is None:
        return [call(r) for r in (0, 1)]
    return together([lambda r=r: call(r) for r in (0, 1)], hub)


def reference(node: Node, whole: dict[str, Any]) -> Any:
    """The op on whole tensors, on one device (a random op from the ranks' generator state)."""
    if node.target in RANDOM_DRAWS:
        torch.manual_seed(SEED)
    it = iter(node.inputs)
    resolve = lambda _name: whole[next(it)]
    args = decode_arg(list(node.args), resolve)
    kwargs = {k: decode_arg(v, resolve) for k, v in node.kwargs.items()}
    return run_target(node.target)(*args, **kwargs)


def sharding_rules(node: Node, values: dict[str, Any]) -> list[Rule]:
    metas = tuple(meta(first(values[t])) for t in node.inputs)
    rules = rules_for(node, metas)
    return [r for r in rules if PMAX not in r.inputs and (r.output.is_shard or any(l.is_shard for l in r.inputs))]


OPS = [op for op in accepted_ops() if op not in NOT_RUN]


def test_every_accepted_op_has_a_sample() -> None:
    missing = [op for op in OPS if samples(op) is None]
    assert not missing, f"ops of the rule surface without a zero-length sample (add them to SAMPLES): {missing}"


@pytest.mark.parametrize("target", OPS)
def test_op_runs_on_zero_length_shards(target: str) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    cases = samples(target)
    if cases is None:
        pytest.fail(f"{target}: no sample (add one to SAMPLES)")
    sharded = 0
    for sample in cases:
        node, values = make_node(target, sample)
        for rule in sharding_rules(node, values):
            for empty in (0, 1):
                check_rule(target, node, values, rule, empty, g)
            sharded += 1
    if target in UNSHARDED:
        assert not sharded, f"{target} has a sharding rule now: remove it from UNSHARDED"
    else:
        assert sharded, f"{target}: no rule of its samples shards anything; give a sample with larger dims"


# -- end to end: an FFT model with three empty ranks ------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


FFT_MODEL = """
import torch
from torch import nn


class FFTModel(nn.Module):
    \"\"\"A linear, an FFT over the sequence, its magnitudes, a linear, a squared error.\"\"\"

    def __init__(self, hidden):
        super().__init__()
        self.inp = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x, target):
        spectrum = torch.fft.rfft(self.inp(x), dim=1)  # [b, s // 2 + 1, h], complex
        return (self.out(spectrum.abs()) - target).pow(2).mean()


def fft_model(batch=4, seq=8, hidden=8):
    torch.manual_seed(0)
    return FFTModel(hidden), (torch.randn(batch, seq, hidden), torch.randn(batch, seq // 2 + 1, hidden))
"""


ONE_NODE = """
name = "one-node"
[device_kinds.cpu]
throughput_flops = 20e9
memory_gib = 4
memory_bandwidth_gbyte_s = 5
[[nodes]]
name = "here"
kind = "cpu"
num_devices = 4
[links]
intra_node_bandwidth_gbps = 8
intra_node_latency_us = 50
inter_node_bandwidth_gbps = 0.2
inter_node_latency_us = 300
"""


def hetsynth_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetsynth", *args], capture_output=True, text=True, cwd=ROOT,
                          env=os.environ, timeout=600)


@pytest.mark.slow
def test_fft_model_with_three_empty_ranks_runs_and_checks(tmp_path: Path) -> None:
    """Ratios 1,0,0,0 on one node of 4 CPU devices, run as plain local processes (what is
    tested is the program, not emulated links and quotas): ranks 1-3 hold no rows of the
    batch, and `run --check` trains and matches single-device training (oneMKL refuses an FFT
    of no rows; those ranks make empty results without calling it)."""
    (tmp_path / "fft.py").write_text(FFT_MODEL)
    spec = tmp_path / "one-node.toml"
    spec.write_text(ONE_NODE)
    plan = str(tmp_path / "plan.json")
    out = hetsynth_cli("plan", "--model", f"{tmp_path / 'fft.py'}:fft_model", "--cluster", str(spec),
                       "--ratios", "1,0,0,0", "-o", plan)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    out = hetsynth_cli("run", plan, "--steps", "2", "--check")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "check: float64" in out.stdout and "OK" in out.stdout, out.stdout[-3000:]
