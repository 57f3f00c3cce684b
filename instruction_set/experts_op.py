"""Routed experts as one op: `hetsynth::routed_experts`, the unit expert parallelism shards.

Why one op. transformers' experts implementations (integrations/moe.py) route in the data:
`grouped_mm` sorts the (token, expert) pairs by expert and multiplies runs of rows whose
bounds are values (histc, cumsum), `batched_mm` gathers a copy of the weights per pair. No
layout of the sorted rows says which rank holds which expert, so neither form lets the
search split the experts (instruction_set.rules.moe). As one op, the block

    out[t] = sum_j  w[t, j] * E_{idx[t, j]}(x[t]),   E_e(v) = down_e (act(gate_e v) * up_e v)

(x[T, H] tokens, idx[T, k] the experts each token picked, w[T, k] their routing weights,
gate_up[E, 2F, H] = [gate_e; up_e] per expert, down[E, H, F]) is a sum over experts, and a
sum over experts is what expert parallelism splits: a rank holding experts [first, first + E_r)
computes the terms of its experts for every token and zero for the others; the ranks' results
sum to `out` (a Partial), and the expert weights need no gradient synchronisation. The rules
(instruction_set.rules.moe) give the search four choices for the op: all replicated; tokens
split with the experts replicated (data parallel, gradients all-reduced); tokens replicated with
the experts split unevenly (the LP sizes each rank's run of experts: more experts on faster
devices), whose tokens arrive by an all-gather and whose Partial output leaves by a
reduce-scatter (local `experts_sharded`); and tokens and experts both split (local
`experts_dispatched`, `dispatched_math`): each (token, slot) pair travels to the rank holding
its expert by an all-to-all of rows, in counts exchanged first, and its result comes back by
the reverse one. The op's `first` argument is the global index of the weights' first expert: 0
in the captured graph, the rank's offset under `experts_sharded`.

Per rank r of T_r tokens holding E_r of E experts, the all-gather brings (T - T_r) H values and
the reduce-scatter returns as many, while the dispatch sends k T_r H (1 - E_r / E) each way and
receives k (T - T_r) H E_r / E: the all-to-all pays at many devices and small k, and it also
splits the tokens' other work (the router, the output). Which is cheaper is the search's to
say (planner.problem.Problem.op_communication charges the dispatch's all-to-alls).

Expected loads. Unless told otherwise the routing is taken as uniform: a rank's share of the
pairs is its share of the experts. A trained router is not uniform; the user may give each
expert's expected share of the pairs (`with_expert_loads`: a routing histogram), kept on the
graph (ReferenceGraph.expert_loads), and then a rank's work under an expert split is the sum of
its experts' loads (planner.problem.Problem.rule_shares), which the prediction and the search's
choice between the rules use. The ratio LP still moves the experts' boundaries as if the loads
were uniform (a rank's load is piecewise linear in where its run of experts starts and ends,
which the LP's affine forms do not express), so the placement follows the devices' speeds and
the loads price it.

Routing (softmax, top-k, the auxiliary load-balancing loss) stays outside, as ordinary ops, so
the router's loss is part of the captured loss as the model computes it.

Backward: `routed_experts_backward`, a second op (so that FlopCounterMode can count it by
formula and fake tensors can run it), the chain rule per expert written out with aten's own
activation backward kernels (an op's implementation runs below autograd). Dispatched, the
backward is autograd's through `dispatched_math`'s plain ops and the exchanges' adjoints (the
reverse all-to-alls); every rank joins both, in the same order, whatever it holds.
FLOPs: forward 2 T k (2 F H + F H) (each pair meets one expert's three matrices), backward
twice that (input and weight gradients), under uniform routing for any rank's share.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F

from hetsynth.instruction_set.graph import Node, ReferenceGraph
from hetsynth.instruction_set.shards import MeshLayout

OP = "hetsynth.routed_experts.default"
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
    "gelu_pytorch_tanh": lambda v: F.gelu(v, approximate="tanh"),
}
_aten = torch.ops.aten
ACTIVATION_GRADS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "silu": _aten.silu_backward.default, "swish": _aten.silu_backward.default,
    "gelu": _aten.gelu_backward.default, "relu": lambda g, v: _aten.threshold_backward.default(g, v, 0.0),
    "gelu_pytorch_tanh": lambda g, v: _aten.gelu_backward.default(g, v, approximate="tanh"),
}


def expert_ffn(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    """E(rows) = down (act(gate rows) * up rows) for one expert's gate_up[2F, H], down[H, F]."""
    width = gate_up.shape[0] // 2
    h = rows @ gate_up.transpose(0, 1)
    return (ACTIVATIONS[act](h[:, :width]) * h[:, width:]) @ down.transpose(0, 1)


def routed_experts_math(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
                        down: torch.Tensor, act: str, first: int) -> torch.Tensor:
    """The terms of experts [first, first + gate_up.shape[0]) (see the module docstring), in
    plain differentiable ops: pairs of other experts contribute zero."""
    out = x.new_zeros(x.shape).to(torch.promote_types(x.dtype, w.dtype))
    for e in range(gate_up.shape[0]):
        token, slot = torch.nonzero(idx == first + e, as_tuple=True)
        if token.numel() == 0:
            continue
        y = expert_ffn(x[token], gate_up[e], down[e], act)
        out = out.index_add(0, token, y * w[token, slot].unsqueeze(-1))
    return out.to(x.dtype)


class Exchange(Protocol):
    """Rows between the members of a group (runtime.collectives.alltoall.RowExchange)."""

    def counts(self, send: list[int]) -> list[int]:
        """How many rows each member sends me, given how many I send each."""
        ...

    def rows(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """My rows, `send[j]` of them in order to member j; the rows received, by member
        (differentiable: the backward sends the gradients back the same way)."""
        ...


def dispatched_math(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, act: str, starts: Sequence[int], member: int,
                    exchange: Exchange) -> torch.Tensor:
    """The routed-experts op with tokens and experts both split (local `experts_dispatched`):
    this member holds tokens x[T_m, H] (their idx, w) and experts [starts[m], starts[m+1]).
    Each (token, slot) pair goes to the member owning its expert (an all-to-all of rows, sizes
    from the exchanged counts), is computed there, and comes back (the reverse all-to-all),
    where out[t] = sum_j w[t, j] y[t, j] as on one device. For k = 2 the two terms of a
    token add in either order to the same bits (a + b = b + a, and 0 + a = a); for k > 2
    they may round differently at the last place."""
    owner = torch.bucketize(idx.reshape(-1), torch.tensor(list(starts[1:-1]), dtype=idx.dtype,
                                                          device=idx.device), right=True)
    order = torch.argsort(owner, stable=True)
    send = torch.bincount(owner, minlength=len(starts) - 1).tolist()
    recv = exchange.counts(send)
    token = torch.div(order, idx.shape[1], rounding_mode="floor")
    rows = exchange.rows(x[token], send, recv)
    experts = exchange.rows(idx.reshape(-1)[order], send, recv) - starts[member]
    # zeros joined in autograd to the received rows and to this member's experts: every member's
    # backward then runs both exchanges' adjoints, in the same order, whatever pairs reached it
    # (else a member with none would leave the others waiting), and its experts get a gradient
    # (zeros where no pair reached them, as on one device) every step
    y = rows * 0 + (gate_up.sum() + down.sum()) * 0
    for e in range(gate_up.shape[0]):
        mine = torch.nonzero(experts == e, as_tuple=True)[0]
        if mine.numel():  # in y's dtype: under autocast the matmuls return 16-bit rows
            y = y.index_add(0, mine, expert_ffn(rows[mine], gate_up[e], down[e], act).to(y.dtype))
    back = exchange.rows(y, recv, send)
    out = x.new_zeros(x.shape).to(torch.promote_types(x.dtype, w.dtype))
    return out.index_add(0, token, back * w.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)


@torch.library.custom_op("hetsynth::routed_experts", mutates_args=())
def routed_experts(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, act: str, first: int) -> torch.Tensor:
    return routed_experts_math(x, idx, w, gate_up, down, act, first)


@routed_experts.register_fake
def _routed_experts_fake(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
                         down: torch.Tensor, act: str, first: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("hetsynth::routed_experts_backward", mutates_args=())
def routed_experts_backward(grad: torch.Tensor, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                            gate_up: torch.Tensor, down: torch.Tensor, act: str,
                            first: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, dgate_up, ddown), per expert e with rows X of its pairs, weights s:
    h = X G^T = [g, u], m = act(g) u, y = m D^T; dy = s grad, ds = <grad, y>,
    dD = dy^T m, dm = dy D, dh = [act'(g) (dm u), dm act(g)], dG = dh^T X, dX = dh G."""
    dx, dw = torch.zeros_like(x), torch.zeros_like(w)
    dgate_up, ddown = torch.zeros_like(gate_up), torch.zeros_like(down)
    width = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        token, slot = torch.nonzero(idx == first + e, as_tuple=True)
        if token.numel() == 0:
            continue
        rows, up_go = x[token], grad[token]
        h = rows @ gate_up[e].transpose(0, 1)
        gate, up = h[:, :width], h[:, width:]
        m = ACTIVATIONS[act](gate) * up
        y = m @ down[e].transpose(0, 1)
        dw[token, slot] = (up_go * y).sum(-1)
        dy = up_go * w[token, slot].unsqueeze(-1)
        ddown[e] = dy.transpose(0, 1) @ m
        dm = dy @ down[e]
        dh = torch.cat([ACTIVATION_GRADS[act](dm * up, gate), dm * ACTIVATIONS[act](gate)], dim=1)
        dgate_up[e] = dh.transpose(0, 1) @ rows
        dx = dx.index_add(0, token, dh @ gate_up[e])
    return dx, dw, dgate_up, ddown


@routed_experts_backward.register_fake
def _routed_experts_backward_fake(grad: torch.Tensor, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                                  gate_up: torch.Tensor, down: torch.Tensor, act: str, first: int) -> Any:
    return tuple(torch.empty_like(t) for t in (x, w, gate_up, down))


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, idx, w, gate_up, down, act, first = inputs
    ctx.save_for_backward(x, idx, w, gate_up, down)
    ctx.act, ctx.first = act, first


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    x, idx, w, gate_up, down = ctx.saved_tensors
    dx, dw, dgate_up, ddown = routed_experts_backward(grad.contiguous(), x, idx, w, gate_up, down,
                                                       ctx.act, ctx.first)
    return dx, None, dw, dgate_up, ddown, None, None


routed_experts.register_autograd(_backward, setup_context=_setup_context)


Loads = Sequence[float] | Mapping[str, Sequence[float]]


def with_expert_loads(graph: ReferenceGraph, loads: Loads) -> ReferenceGraph:
    """The graph with the routed-experts ops' expected loads (module docstring): one list of
    numbers for every such op, or {op name or module path: numbers}; each list one
    non-negative number per expert, not all zero, scaled to sum to 1. ValueError naming the
    value and what would be valid otherwise."""
    ops = [n for n in graph.calls if n.target == OP]
    if not ops:
        raise ValueError(f"expert loads given, but {graph.model_ref} has no routed-experts op "
                         "(an MoE model captured with experts=routed has one per MoE layer)")
    if isinstance(loads, Mapping):
        if not loads:
            raise ValueError("expert loads: an empty mapping; give {MoE op name or module path: loads}")
        names = {k: n for n in ops for k in (n.name, n.module_path) if k}
        unknown = [k for k in loads if k not in names]
        if unknown:
            raise ValueError(f"expert loads for {unknown[0]!r}: no routed-experts op of that name or module path; "
                             f"valid: {', '.join(sorted(names)[:8])}{' ...' if len(names) > 8 else ''}")
        given = {names[k].name: (names[k], v) for k, v in loads.items()}
    else:
        given = {n.name: (n, loads) for n in ops}
    out = dict(graph.expert_loads)
    for name, (node, values) in given.items():
        out[name] = _normalized(node, values, graph)
    return graph.model_copy(update={"expert_loads": out})


def rank_loads(loads: Sequence[float], lengths: Sequence[int], placed: MeshLayout) -> list[float]:
    """Each rank's share of the routed pairs: the loads of its run of experts [o, o + n), its
    offset o where `placed` puts it and n its length."""
    return [math.fsum(loads[placed.offset(lengths, 0, rank):][:n]) for rank, n in enumerate(lengths)]


def _normalized(node: Node, values: Sequence[float], graph: ReferenceGraph) -> tuple[float, ...]:
    experts = graph.node(node.inputs[3]).out.shape[0]
    where = f"expert loads of {node.module_path or node.name}"
    odd = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float))]
    if odd or isinstance(values, (str, bytes)):
        raise ValueError(f"{where}: {(odd or [values])[0]!r} is not a number; give one number per expert")
    numbers = [float(v) for v in values]
    if len(numbers) != experts:
        raise ValueError(f"{where}: {len(numbers)} numbers for {experts} experts; give one per expert")
    bad = [v for v in numbers if not math.isfinite(v) or v < 0]
    if bad or sum(numbers) <= 0:
        raise ValueError(f"{where}: {bad[0] if bad else numbers}: give finite, non-negative numbers, not all zero")
    total = sum(numbers)
    return tuple(v / total for v in numbers)


def routed_experts_flops(x_shape: Any, idx_shape: Any, w_shape: Any, gate_up_shape: Any, down_shape: Any,
                         *args: Any, **kwargs: Any) -> int:
    """2 T k (2F H + H F): every (token, expert) pair meets one expert's matrices (uniform
    routing; under the expert split a rank's share of the pairs is its share of experts)."""
    pairs = idx_shape[0] * idx_shape[1]
    return 2 * pairs * (gate_up_shape[1] * gate_up_shape[2] + down_shape[1] * down_shape[2])


def routed_experts_backward_flops(grad_shape: Any, x_shape: Any, idx_shape: Any, w_shape: Any,
                                  gate_up_shape: Any, down_shape: Any, *args: Any, **kwargs: Any) -> int:
    """Input and weight gradients: twice the forward."""
    return 2 * routed_experts_flops(x_shape, idx_shape, w_shape, gate_up_shape, down_shape)


FLOP_FORMULAS = {torch.ops.hetsynth.routed_experts: routed_experts_flops,
                 torch.ops.hetsynth.routed_experts_backward: routed_experts_backward_flops}
