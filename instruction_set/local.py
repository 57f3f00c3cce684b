"""What one rank computes for an op under a rule: the op on its local shards, rewritten.

`emit_local` turns a reference-graph node, one of its rules and a rank's `LocalContext` into
calls on a `Builder`: an eager builder runs them on tensors (the single-process rule tests),
the runtime's builder adds them to a torch.fx graph (runtime.codegen). One code path, so the
rules tested in one process are the rules the runtime executes. Rewrites:

- shape arguments (view sizes, expand sizes) become the local output shape;
- `once:i` (optionally `@outer` / `@inner`): input i is an addend (a bias, a replicated
  term added to a Partial) that must count once in the sum over ranks, so ranks other than
  the keeper use `zeroed(x)` instead (zeros that keep x in the autograd graph);
- `mean_global`: a mean over a split dim is the local sum divided by the global count;
- `gather_sharded` / `embedding_sharded`: a rank holding rows [offset, offset + len) of the
  table looks up the indices in that range and contributes zeros for the others (P output);
- `experts_sharded`: routed experts (instruction_set.experts_op) on a rank holding experts
  [offset, offset + len) of the expert weights (input 3): the op with `first = offset` (P);
- `experts_dispatched`: routed experts with tokens and experts split: an exchange of rows
  between ranks, so the runtime builds it (runtime.experts) and `emit_local` refuses it;
- `amax_sharded`: a max over a split dim that tolerates an empty local shard (-inf);
- an op that draws random values (RANDOM_DRAWS: dropout, bernoulli, rand_like, exponential,
  uniform, ...), whatever its rule, runs as `draw_whole`: the rank draws the op's whole
  (global-shaped) tensor and keeps its window, so its values are the ones one device draws at
  those positions, and every rank's generator advances as one device's does (torch's CPU
  generator has no offsets: a draw of the window alone would take the stream's first values);
- on a rank whose outputs of the node are all empty (zero-length shards are legal), the op
  is not called: `empty_result` makes them, in the plan's local shapes and dtypes.

The functions below are what the generated per-rank programs call (they appear in
`hetsynth explain` output as `instruction_set.local.<name>`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
import torch.nn.functional as F

from hetsynth.instruction_set.args import decode_arg
from hetsynth.instruction_set.graph import Node, ReferenceGraph
from hetsynth.instruction_set.interpret import resolve_target, run_target
from hetsynth.instruction_set.rules import SHAPE_ARG
from hetsynth.instruction_set.rules.conv import PLANE_OPS


class Builder(Protocol):
    def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict, name: str | None = None) -> Any: ...


class EagerBuilder:
    """Runs each call immediately on tensors."""

    def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict, name: str | None = None) -> Any:
        return fn(*args, **kwargs)


@dataclass(frozen=True)
class LocalContext:
    """One rank's view of a node under a rule."""

    out_shapes: tuple[tuple[int, ...], ...]      # local shape of each output
    device: torch.device = torch.device("cpu")
    dropped: frozenset[int] = frozenset()        # input positions replaced by zeros (not keeper)
    offsets: dict[int, int] = field(default_factory=dict)  # input position -> start of its shard
    global_count: int = 1                        # elements averaged by a global mean
    starts: dict[int, int] = field(default_factory=dict)   # output dim -> start of this rank's window


# -- local rewrites called by generated programs ----------------------------------------------

def mean_global(x: torch.Tensor, dims: Sequence[int] | None, keepdim: bool, count: int,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """Local sum over `dims` divided by the number of elements averaged globally."""
    total = torch.sum(x, dim=list(dims) if dims else None, keepdim=keepdim, dtype=dtype)
    return total / count


def gather_sharded(x: torch.Tensor, dim: int, index: torch.Tensor, offset: int) -> torch.Tensor:
    """gather along a dim of which this rank holds [offset, offset + x.shape[dim]); zeros for
    indices outside. The ranks' results sum to the full gather."""
    size = x.shape[dim]
    local = index - offset
    inside = (local >= 0) & (local < size)
    if size == 0:
        shape = list(x.shape)
        shape[dim] = index.shape[dim]
        return (x.new_zeros(index.shape) if x.dim() == index.dim() else x.new_zeros(shape)) + in_autograd(x)
    picked = torch.gather(x, dim, local.clamp(0, size - 1))
    return picked * inside.to(picked.dtype)


def embedding_sharded(weight: torch.Tensor, indices: torch.Tensor, offset: int,
                      padding_idx: int = -1) -> torch.Tensor:
    """Lookup in rows [offset, offset + len) of the table; zeros for other ids."""
    rows = weight.shape[0]
    local = indices - offset
    inside = (local >= 0) & (local < rows)
    if rows == 0:
        return weight.new_zeros((*indices.shape, weight.shape[1])) + in_autograd(weight)
    pad = padding_idx - offset if padding_idx >= 0 and 0 <= padding_idx - offset < rows else None
    out = F.embedding(local.clamp(0, rows - 1), weight, padding_idx=pad)
    return out * inside.unsqueeze(-1).to(out.dtype)


def in_autograd(*tensors: Any) -> torch.Tensor | float:
    """A zero that depends on every differentiable tensor of `tensors`: added to a result made
    without them (an empty shard's), it keeps them in the autograd graph, so the collectives in
    their backward still run on this rank (a rank that skipped them would deadlock the others).
    The sum of no element of each, not `sum() * 0`, which an infinite element makes NaN."""
    zero: torch.Tensor | float = 0.0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            zero = zero + (t.real if t.is_complex() else t).reshape(-1)[:0].sum()
    return zero


def amax_sharded(x: torch.Tensor, dims: Sequence[int], keepdim: bool = False) -> torch.Tensor:
    """amax that gives -inf over an empty local shard (its result is Pmax)."""
    dims = sorted(d % x.dim() for d in dims) if dims else list(range(x.dim()))
    if all(x.shape[d] > 0 for d in dims):
        return torch.amax(x, dims, keepdim)
    if keepdim:
        shape = [1 if d in dims else s for d, s in enumerate(x.shape)]
    else:
        shape = [s for d, s in enumerate(x.shape) if d not in dims]
    return x.new_full(shape, float("-inf"))


def convolution(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Sequence[int],
                padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                output_padding: Sequence[int], groups: int) -> torch.Tensor:
    """aten.convolution on local shards: a non-transposed convolution takes its groups from
    the local channels (a depthwise shard holds whole groups), and zero-length channel shards
    are allowed (torch rejects an empty weight)."""
    if not transposed and weight.shape[1] > 0:
        groups = x.shape[1] // weight.shape[1]
    conv = torch.ops.aten.convolution.default
    if x.shape[1] > 0 and weight.numel() > 0:
        return conv(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    out_channels = weight.shape[1] * groups if transposed else weight.shape[0]
    probe = conv(x.new_zeros(x.shape[0], 1, *x.shape[2:]), weight.new_zeros(1, 1, *weight.shape[2:]), None,
                 stride, padding, dilation, transposed, output_padding, 1)
    out = probe.new_zeros(probe.shape[0], out_channels, *probe.shape[2:])
    out = out + (x.sum() * 0 + weight.sum() * 0)  # keep both in the autograd graph
    return out + bias.view(1, -1, *[1] * (out.dim() - 2)) if bias is not None else out


def _size_tolerant(op: Callable[..., Any]) -> Callable[..., Any]:
    """A plane op (pooling, upsampling, padding) that accepts zero-length leading dims (torch
    rejects 0 channels): run on size 1 there, keep none of it."""

    def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        empty = [d for d, s in enumerate(x.shape) if s == 0]
        if not empty:
            return op(x, *args, **kwargs)
        probe = x.new_zeros([1 if s == 0 else s for s in x.shape])
        out = op(probe, *args, **kwargs)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        for d in empty:
            outs = [o.narrow(d, 0, 0) for o in outs]
        outs = [o + x.sum() * 0 if o.is_floating_point() else o for o in outs]
        return tuple(outs) if isinstance(out, (tuple, list)) else outs[0]

    run.__name__ = run.__qualname__ = str(op).split(".")[1] + "_any_size"
    return run


def empty_result(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype], multi: bool,
                 device: torch.device, inputs: Any) -> Any:
    """A node's outputs on a rank where all of them are empty (zero-length shards are legal):
    new tensors of the plan's local shapes and dtypes, no kernel called (library kernels may
    refuse empty input: oneMKL's FFT raises "Inconsistent configuration parameters"). They
    stay in the autograd graph of `inputs`, the op's inputs (in_autograd)."""
    zero = in_autograd(*_tensors(inputs))
    outs = [torch.empty(tuple(s), dtype=d, device=device) for s, d in zip(shapes, dtypes)]
    outs = [o + zero if (o.is_floating_point() or o.is_complex()) and torch.is_tensor(zero) else o for o in outs]
    return tuple(outs) if multi else outs[0]


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in nested tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def all_empty(shapes: Sequence[Sequence[int]]) -> bool:
    """Every output shape has no element (and there is at least one)."""
    return bool(shapes) and all(math.prod(s) == 0 for s in shapes)


# Ops that draw one random value per output element, whatever their input's values (their
# first input gives the shape, dtype and device; dropout also scales it by the draw).
RANDOM_DRAWS = frozenset({
    "aten.native_dropout.default", "aten.dropout.default", "aten.bernoulli.p", "aten.rand_like.default",
    "aten.randn_like.default", "aten.exponential.default", "aten.uniform.default",
})
_DROPOUTS = frozenset({"aten.native_dropout.default", "aten.dropout.default"})


def draw_whole(target: str, whole: Sequence[int], starts: Sequence[int], x: torch.Tensor, *args: Any,
               **kwargs: Any) -> Any:
    """A random op on this rank's window of its output, dims [starts[d], starts[d] + x.shape[d]):
    the op drawn on a whole-shaped stand-in for `x` (`whole_draw`), narrowed to the window
    (`on_window`). Exact: the values are one device's at those positions, and the generator
    ends where one device's does."""
    return on_window(target, whole_draw(target, whole, x.dtype, x.device, args, kwargs), starts, x)


def whole_draw(target: str, whole: Sequence[int], dtype: torch.dtype, device: torch.device, args: Sequence[Any],
               kwargs: dict[str, Any]) -> Any:
    """The random op drawn on ones of the whole shape (`args`, `kwargs`: the op's arguments after
    its tensor), or None where one device draws nothing: dropout with `p = 0` or not training
    (eager dropout returns its input; aten.native_dropout would draw a mask of ones, so a later
    draw would fall out of step with one device's). Dropout's draw on ones is `m / (1 - p)`, m
    the kept-element mask (native_dropout returns m too)."""
    if target in _DROPOUTS:
        p = args[0] if args else kwargs["p"]
        train = args[1] if len(args) > 1 else kwargs.get("train")
        if p == 0 or train is False:
            return None
    return run_target(target)(torch.ones(tuple(whole), dtype=dtype, device=device), *args, **kwargs)


def on_window(target: str, drawn: Any, starts: Sequence[int], x: torch.Tensor) -> Any:
    """The op's result on `x`, this rank's window (from `starts`) of its input, given the whole
    draw `drawn` (whole_draw's): dropout is `x * (m / (1 - p))` over the window, one device's
    output there; the others are the window of the draw."""
    if drawn is None:  # dropout that drops nothing
        return (x * 1, torch.ones_like(x, dtype=torch.bool)) if target == "aten.native_dropout.default" else x * 1
    window = lambda t: _narrowed(t, starts, x.shape)
    if target == "aten.native_dropout.default":
        scaled, mask = drawn
        return x * window(scaled), window(mask)
    if target == "aten.dropout.default":
        return x * window(drawn)
    return window(drawn) + in_autograd(x)  # x's gradient is zero, as one device's (exponential_, uniform_)


def _narrowed(t: torch.Tensor, starts: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    for d, (start, size) in enumerate(zip(starts, shape)):
        if size != t.shape[d]:
            t = t.narrow(d, start, size)
    return t


SDPA = "aten.scaled_dot_product_attention.default"
MAY_DRAW = RANDOM_DRAWS | {SDPA}  # ops that may draw random values (`draws` says whether a node does)


def sdpa_dropout(a: Sequence[Any], k: dict[str, Any]) -> float:
    """The dropout probability of a scaled_dot_product_attention call (decoded arguments)."""
    return float(a[4] if len(a) > 4 else k.get("dropout_p", 0.0))


def draws(node: Node, a: Sequence[Any], k: dict[str, Any]) -> bool:
    """Whether `node` draws random values: a random op (RANDOM_DRAWS), or attention with
    dropout (its weights' mask)."""
    return node.target in RANDOM_DRAWS or (node.target == SDPA and sdpa_dropout(a, k) > 0)


def graph_draws(nodes: Sequence[Node]) -> bool:
    """Whether any of `nodes` draws random values (`draws`, arguments decoded without values)."""
    for node in nodes:
        if node.target in MAY_DRAW:
            a, k = decoded(node, [None] * len(node.inputs), torch.device("cpu"))
            if draws(node, a, k):
                return True
    return False


def whole_draw_bytes(graph: ReferenceGraph, node: Node) -> int:
    """Bytes a rank holds while it draws `node`'s whole tensor (the stand-in of ones and the
    draw: draw_whole, attention_dropout_whole), on top of its own shards; 0 for a node that
    draws nothing."""
    if node.target not in MAY_DRAW:
        return 0
    a, k = decoded(node, [None] * len(node.inputs), torch.device("cpu"))
    if not draws(node, a, k):
        return 0
    first = graph.node(node.inputs[0]).out
    whole = (attention_weights_shape(node.outputs[0].shape, graph.node(node.inputs[1]).out.shape[-2])
             if node.target == SDPA else node.outputs[0].shape)
    return 2 * math.prod(whole) * torch.empty((), dtype=getattr(torch, first.dtype)).element_size()


def attention_weights_shape(out: Sequence[int], key_length: int) -> tuple[int, ...]:
    """The attention weights' shape [..., L, S] for an output [..., L, Ev] and S keys."""
    return (*out[:-1], key_length)


def attention_drawn(drawn: torch.Tensor, starts: Sequence[int], q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                    is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """scaled_dot_product_attention with dropout on this rank's window of the batch and heads,
    given the whole weights' draw (`drawn`: dropout of ones, `m / (1 - p)`, as one device's
    math kernel draws it; `starts` of the weights' window): softmax(q k^T * scale + mask) *
    window(drawn) @ v, the math one device computes (its CPU kernels take this path under
    dropout)."""
    if enable_gqa and k.shape[-3] and q.shape[-3] != k.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    weights = torch.softmax(scores, dim=-1)
    return (weights * _narrowed(drawn, starts, weights.shape)) @ v


def _draw_args(node: Node, a: tuple, ctx: LocalContext) -> tuple:
    """draw_whole's leading arguments for `node` on this rank: its target, whole shape and
    window starts (every dim whose local length is not the whole must have a start)."""
    return (node.target, tuple(node.outputs[0].shape), window_starts(node, ctx), *a)


def window_starts(node: Node, ctx: LocalContext) -> tuple[int, ...]:
    """The start of this rank's window in each dim of `node`'s output; ValueError where a
    split dim has none."""
    whole, local = node.outputs[0].shape, ctx.out_shapes[0]
    missing = [d for d, (w, n) in enumerate(zip(whole, local)) if w != n and d not in ctx.starts]
    if missing:
        raise ValueError(f"{node.name} ({node.target}): dims {missing} are split ({local} of {whole}) "
                         f"but the rank's window starts are not given")
    return tuple(ctx.starts.get(d, 0) for d in range(len(whole)))


def attention_dropout_whole(whole_out: Sequence[int], starts: Sequence[int], q: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                            is_causal: bool = False, scale: float | None = None,
                            enable_gqa: bool = False) -> torch.Tensor:
    """Attention with dropout on this rank's window (`starts` of the output, whole shape
    `whole_out`): the whole weights' dropout drawn here, then attention_drawn."""
    whole = attention_weights_shape(whole_out, k.shape[-2])
    drawn = whole_draw("aten.dropout.default", whole, q.dtype, q.device, (dropout_p, True), {})
    return attention_drawn(drawn, (*starts[:-1], 0), q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


# Ops run through a size-tolerant wrapper on every rank.
LOCAL_TARGETS: dict[str, Callable[..., Any]] = {
    "aten.convolution.default": convolution,
    **{name: _size_tolerant(resolve_target(name)) for name in PLANE_OPS},
}


# -- emitting a node -----------------------------------------------------------------------------

def _resolver(values: Sequence[Any]) -> Callable[[str], Any]:
    it: Iterator[Any] = iter(values)
    return lambda _name: next(it)


def zeroed(x: torch.Tensor) -> torch.Tensor:
    """Zeros that stay connected to x in autograd: collectives in x's backward still run on
    every rank (a rank that skipped them would deadlock the others)."""
    return x * 0


def _inputs(node: Node, inputs: Sequence[Any], ctx: LocalContext, builder: Builder) -> list[Any]:
    return [builder.call(zeroed, (v,), {}) if i in ctx.dropped else v for i, v in enumerate(inputs)]


def decoded(node: Node, inputs: Sequence[Any], device: torch.device) -> tuple[tuple, dict[str, Any]]:
    """`node`'s arguments with its inputs' values (`inputs`, in Node.inputs order) in place."""
    resolve = _resolver(inputs)
    return (tuple(decode_arg(list(node.args), resolve, device)),
            {name: decode_arg(v, resolve, device) for name, v in node.kwargs.items()})


def emit_local(node: Node, local: str, inputs: Sequence[Any], ctx: LocalContext, builder: Builder) -> Any:
    """Emit the rank-local computation of `node`; `inputs` are its inputs' local values in
    Node.inputs order (already in the rule's layouts)."""
    values = _inputs(node, inputs, ctx, builder)
    args = list(node.args)
    if node.target in SHAPE_ARG and SHAPE_ARG[node.target] < len(args):
        args[SHAPE_ARG[node.target]] = list(ctx.out_shapes[0])
    resolve = _resolver(values)
    a = tuple(decode_arg(args, resolve, ctx.device))
    k = {name: decode_arg(v, resolve, ctx.device) for name, v in node.kwargs.items()}
    if node.target in RANDOM_DRAWS:  # before the empty-shard shortcut: an empty window still draws
        return builder.call(draw_whole, _draw_args(node, a, ctx), k, name=node.name)
    if draws(node, a, k):  # attention with dropout
        return builder.call(attention_dropout_whole, (tuple(node.outputs[0].shape), window_starts(node, ctx), *a),
                            k, name=node.name)
    if all_empty(ctx.out_shapes):  # this rank's shard is empty: no kernel sees it
        dtypes = [getattr(torch, m.dtype) for m in node.outputs]
        return builder.call(empty_result, (list(ctx.out_shapes), dtypes, node.multi_output, ctx.device, [a, k]), {},
                            name=node.name)
    fn, a, k = _local_call(node, local_kinds(local), a, k, ctx)
    return builder.call(fn, a, k, name=node.name)


def _local_call(node: Node, kinds: set[str], a: tuple, k: dict,
                ctx: LocalContext) -> tuple[Callable[..., Any], tuple, dict]:
    """(function, args, kwargs) computing the node on this rank under the rewrites `kinds`."""
    if "mean_global" in kinds:
        return (mean_global, *_mean_args(node, a, k, ctx))
    if "gather_sharded" in kinds:
        return gather_sharded, (a[0], a[1], a[2], ctx.offsets[0]), {}
    if "embedding_sharded" in kinds:
        pad = a[2] if len(a) > 2 else k.get("padding_idx", -1)
        return embedding_sharded, (a[0], a[1], ctx.offsets[0], pad), {}
    if "experts_sharded" in kinds:
        return run_target(node.target), (*a[:6], ctx.offsets[3]), {}
    if "experts_dispatched" in kinds:
        raise ValueError(f"{node.name}: experts_dispatched exchanges rows between ranks; "
                         "runtime.experts builds it, not a local rewrite")
    if "amax_sharded" in kinds:
        return amax_sharded, (a[0], a[1] if len(a) > 1 else [], a[2] if len(a) > 2 else False), {}
    return LOCAL_TARGETS.get(node.target) or run_target(node.target), a, k


def local_kinds(local: str) -> set[str]:
    """'once:2@outer,mean_global' -> {'once', 'mean_global'}."""
    return {part.split("@")[0].split(":")[0] for part in local.split(",") if part}


def dropped_inputs(local: str, node_index: int, local_index: int) -> frozenset[int]:
    """Inputs a rank replaces by zeros: `once:i` keeps input i on rank (0, 0) only, `@outer`
    on the ranks of node 0, `@inner` on local rank 0 of every node."""
    out = set()
    for part in local.split(","):
        if not part.startswith("once:"):
            continue
        spec, _, axis = part[5:].partition("@")
        keep = {"": node_index == 0 and local_index == 0, "outer": node_index == 0,
                "inner": local_index == 0}[axis]
        if not keep:
            out.add(int(spec))
    return frozenset(out)


def _mean_args(node: Node, a: tuple, k: dict, ctx: LocalContext) -> tuple[tuple, dict]:
    if node.target == "aten.mean.default":
        return (a[0], None, False, ctx.global_count), {"dtype": k.get("dtype")}
    dims = a[1] if len(a) > 1 else k.get("dim")
    keepdim = a[2] if len(a) > 2 else k.get("keepdim", False)
    return (a[0], dims, keepdim, ctx.global_count), {"dtype": k.get("dtype")}
