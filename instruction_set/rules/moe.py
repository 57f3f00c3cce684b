"""Mixture-of-experts ops: grouped matmuls, the expert histogram, and their factories.

HuggingFace transformers (integrations/moe.py, its `grouped_mm` experts implementation, the
default) sorts the (token, expert) pairs by expert, counts the pairs per expert with `histc`,
turns the counts into row offsets with `cumsum`, and multiplies each expert's run of rows by
that expert's weight with one grouped matmul: `aten._grouped_mm` where torch has a kernel,
else its own custom op `transformers.grouped_mm_fallback` (the one a capture records: export
takes transformers' compile path, which avoids the aten kernel for non-bf16 weights).

`grouped_mm(x[S, K], w[E, K, N], offs[E]) -> out[S, N]` computes `out[s] = x[s] @ w[e(s)]`,
`e(s)` the expert whose run [offs[e-1], offs[e]) holds row s. Its rules:

- all R -> R;
- linear in x and in w: x P (w, offs R) -> P, and w P (x, offs R) -> P;
- N split (column-parallel per expert): w S(2), x and offs R -> S(1);
- K split (row-parallel per expert): x S(1), w S(1), offs R -> P.

The rows (tokens) do not shard: which rows belong to which expert depends on the values of
offs, global offsets into the globally sorted rows, so a rank's slice of rows would need its
own offsets. The expert dim of w does not shard either: a rank holding some experts computes
a data-dependent subset of rows, which no layout describes.

`histc(x, bins, min, max)` counts values into fixed bins: with an explicit range (min < max)
the counts of a sharded x are the sums of per-shard counts, S(d) -> P; with the default range
(the data's own min and max) only R -> R. `empty_permuted` is a factory: replicated.

`hetsynth.routed_experts` (instruction_set.experts_op: the whole routed-experts block as one
op, what `hf:<moe>,experts=routed` captures) is where experts split. Its inputs are (x[T, H],
idx[T, k], w[T, k], gate_up[E, 2F, H], down[E, H, F]); its rules:

- all R -> R;
- token parallel: x, idx, w S(0), experts R -> S(0) (each token's output needs only its row);
- expert parallel: x, idx, w R, gate_up and down S(0) -> P, local `experts_sharded`: a rank
  holding experts [o, o + E_r) runs the op with `first = o` (its experts' terms for every
  token; the ranks' outputs sum to the whole). The expert dims of gate_up and down are one
  ratio class of the LP (rule_links), separate from the tokens': the LP places experts unevenly;
- dispatched: tokens and experts both split, x, idx, w S(0) and gate_up, down S(0) -> S(0),
  local `experts_dispatched`: each (token, slot) pair travels to the rank of its expert by an
  all-to-all and its result comes back by another (experts_op.dispatched_math). The experts'
  dims are the rule's work inputs (registry.Rule.work_inputs): their own ratio class, and the
  rank's work is its share of the experts (uniform routing), not of the tokens. The
  all-to-alls are charged with the op (planner.problem.Problem.op_communication).

FLOPs: the grouped matmuls have no formula in torch's FlopCounterMode; `flop_formulas()`
gives them (2 S K N forward, twice that backward: every row meets exactly one expert).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hetsynth.instruction_set.experts_op import FLOP_FORMULAS as EXPERTS_FLOPS
from hetsynth.instruction_set.experts_op import OP as ROUTED_EXPERTS
from hetsynth.instruction_set.graph import Node, TensorMeta
from hetsynth.instruction_set.layouts import P, R, S
from hetsynth.instruction_set.rules.registry import Rule, arg, register, replicated

GROUPED_MM = ("transformers.grouped_mm_fallback.default", "aten._grouped_mm.default")
FACTORIES = ("aten.empty_permuted.default",)


def _grouped_mm(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    """Rules of grouped_mm(x[S, K], w[E, K, N], offs[E]) (see the module docstring)."""
    if len(metas) != 3 or len(metas[0].shape) != 2 or len(metas[1].shape) != 3:
        return replicated(node, metas)  # no offsets, a bias, or a 3-d x: not the MoE form
    (_, k), (_, _, n) = metas[0].shape, metas[1].shape
    rules = [Rule((R, R, R), R), Rule((P, R, R), P), Rule((R, P, R), P)]
    if n > 1:
        rules.append(Rule((R, S(2), R), S(1)))
    if k > 1:
        rules.append(Rule((S(1), S(1), R), P))
    return rules


def _routed_experts(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    """Rules of routed_experts(x, idx, w, gate_up, down) (see the module docstring)."""
    tokens, experts = metas[0].shape[0], metas[3].shape[0]
    rules = [Rule((R,) * 5, R)]
    if tokens > 1:
        rules.append(Rule((S(0), S(0), S(0), R, R), S(0)))
    if experts > 1:
        rules.append(Rule((R, R, R, S(0), S(0)), P, local="experts_sharded"))
    if tokens > 1 and experts > 1:
        rules.append(Rule((S(0),) * 5, S(0), local="experts_dispatched", work_inputs=(3, 4)))
    return rules


def _histc(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    """Counts over an explicit range add up across shards; the default range is the data's."""
    low, high = float(arg(node, 2, "min", 0.0)), float(arg(node, 3, "max", 0.0))
    rules = [Rule((R,), R)]
    if low < high:
        rules += [Rule((S(d),), P) for d, size in enumerate(metas[0].shape) if size > 1]
    return rules


def _grouped_mm_flops(x_shape: Any, w_shape: Any, *args: Any, **kwargs: Any) -> int:
    """2 S K N: every row of x is multiplied by one expert's K x N weight."""
    return 2 * x_shape[0] * x_shape[1] * w_shape[-1]


def _grouped_mm_backward_flops(x_shape: Any, w_shape: Any, *args: Any, **kwargs: Any) -> int:
    """The input gradient and the weight gradient: two grouped matmuls of the forward's size."""
    return 2 * _grouped_mm_flops(x_shape, w_shape)


def _loaded(namespace: str, name: str) -> Any:
    """torch.ops.<namespace>.<name>, or None while the library defining it is not loaded."""
    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None


def flop_formulas() -> dict[Any, Callable[..., int]]:
    """FlopCounterMode `custom_mapping` entries for the grouped matmuls loaded in this process
    (transformers' ops exist once a model using them has been built)."""
    formulas = {"aten._grouped_mm": _grouped_mm_flops,
                "transformers.grouped_mm_fallback": _grouped_mm_flops,
                "transformers.grouped_mm_fallback_backward": _grouped_mm_backward_flops}
    loaded = {name: _loaded(*name.split(".")) for name in formulas}
    loaded_formulas = {packet: formulas[name] for name, packet in loaded.items() if packet is not None}
    return loaded_formulas | EXPERTS_FLOPS


register(GROUPED_MM, _grouped_mm)
register([ROUTED_EXPERTS], _routed_experts)
register(["aten.histc.default"], _histc)
register(FACTORIES, replicated)
