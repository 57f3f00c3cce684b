"""Memory per device: parameters with their gradients and Adam state, and saved activations.

    memory_i = state_i + saved_i + working_i
    state_i  = sum_params bytes_p * (1 param + 1 grad + 2 Adam moments) * s_p,i
             (a ZeRO-1 parameter: bytes_p * (2 + 2 q_i), q_i the device's state ratio;
              ZeRO-2: bytes_p * (1 + 3 q_i), the gradient on the rows too; ZeRO-3: bytes_p * 4 q_i,
              the parameter too, plus its whole bytes twice (W and dW) while one use runs)
    saved_i  = sum_ops sum_{t saved by op} bytes_t * s_t,i     (tensors kept for the backward pass)
    working_i = max_ops sum_{t read or written by op, saved by none} bytes_t * s_t,i + ZeRO-3's
             largest gathered parameter twice   (transients: planner.step_cost.op_working_set,
             zero3_working_set)

with s = 1 for replicated tensors and the device's share for sharded ones (Rajbhandari et
al., ZeRO, SC'20, count 16 bytes per parameter for mixed-precision Adam; we keep the model's
dtype, float32, for all four copies: under a 16-bit precision policy they are the master weights,
and the activations count at the widths autocast gives them, cost_models.precision). The saved tensors are autograd's own, probed at capture
(cost_models.saved_tensors: each storage once, parameters excluded); a saved input or output
scales with the layout the op's rule gives it, a buffer of the op's own (a mask, a
logsumexp) with the rule's share. A graph captured without the probe falls back to the
outputs of non-view ops through which a gradient flows (an upper bound).
`MemoryTerm.part` keeps the two sums apart (and a third, the transient working sets,
counted in the total only) (the plan's prediction reports both;
runtime.memory_report checks them against a run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from hetsynth.cost_models.compute import FREE_OPS
from hetsynth.instruction_set.graph import Node, SavedTensor
from hetsynth.instruction_set.layouts import Layout
from hetsynth.instruction_set.plan import PLANNED_OPTIMIZER, STATE_COPIES

OPTIMIZER_COPIES = STATE_COPIES[PLANNED_OPTIMIZER]  # parameter, gradient, Adam exp_avg, Adam exp_avg_sq

GIB = 2.0**30


@dataclass(frozen=True, slots=True)
class MemoryTerm:
    """bytes on device i = fixed_i + per_share_i * s_i (same form as LinearCost, summed)."""

    fixed: tuple[float, ...]
    per_share: tuple[float, ...]
    part: Literal["state", "saved", "working"] = "saved"  # training state, tensors saved for backward, or a
    # transient working set (one op's unsaved inputs and output, ZeRO-3's gathered parameter and its gradient
    # during one use): in the total only

    def per_device(self, shares: Sequence[float]) -> list[float]:
        return [f + p * s for f, p, s in zip(self.fixed, self.per_share, shares)]


def param_memory(nbytes: float, sharded: bool, n: int) -> MemoryTerm:
    total = nbytes * OPTIMIZER_COPIES
    zeros = (0.0,) * n
    if sharded:
        return MemoryTerm(zeros, (total,) * n, "state")
    return MemoryTerm((total,) * n, zeros, "state")


def zero_memory(nbytes: float, n: int, stage: int) -> MemoryTerm:
    """A ZeRO-`stage` parameter: ZeRO-1 keeps the parameter and its gradient whole and the
    optimizer's copies (OPTIMIZER_COPIES - 2) on the device's share of the rows (its state
    ratio); ZeRO-2 keeps the gradient on the rows too; ZeRO-3 the parameter too. (The
    transient whole tensors, ZeRO-2's gradients until their bucket's copy-in and ZeRO-3's
    gathered parameter and its gradient during one use, are not counted here: held state
    only; planner.step_cost adds ZeRO-3's largest working set.)"""
    whole = {1: 2, 2: 1, 3: 0}[stage]
    return MemoryTerm((whole * nbytes,) * n, ((OPTIMIZER_COPIES - whole) * nbytes,) * n, "state")


ShareOf = Callable[[str, Layout], Sequence[float]]  # a tensor's fraction on each device in a layout


def _split_layout(saved: SavedTensor, inputs: Sequence[Layout], output: Layout) -> Layout | bool:
    """The layout a saved input or output is held in when split; for a buffer of the op's own
    (`internal`), True when the rule splits anything (it scales with the rule's share); False:
    held whole."""
    if saved.source == "input" and saved.index < len(inputs):
        return inputs[saved.index] if inputs[saved.index].is_shard else False
    if saved.source == "output":
        return output if output.is_shard else False
    return any(l.is_shard for l in (output, *inputs))


def saved_name(node: Node, saved: SavedTensor) -> str:
    """The graph tensor a saved input or output is (the op's own name for its internal buffers)."""
    return node.inputs[saved.index] if saved.source == "input" and saved.index < len(node.inputs) else node.name


def activation_memory(node: Node, inputs: Sequence[Layout], output: Layout, n: int,
                      rule_shares: Sequence[float] | None = None, share_of: ShareOf | None = None) -> MemoryTerm:
    """Bytes node saves for backward under a rule reading `inputs` and making `output`:
    fixed_i + per_share_i * s_i, s_i the rule's share where the term is evaluated.

    A split saved tensor t held in layout L_t has nbytes_t * sigma_t,i on device i, sigma_t its
    share in L_t, which need not be the rule's (a linear reading its input S0|R, rows split over
    the nodes, and writing S0|S2, also columns split inside them, saves the input at twice its
    output's share). Given the rule's shares s and `share_of`,
        per_share_i = sum_t nbytes_t * sigma_t,i / s_i      (the ratio of two shares of one op stays
                                                             put as the ratio LP moves s)
    and a device with no share of the op (s_i = 0: zero rows) saves nothing for it, not even the
    tensors every other device holds whole (measured: a rank without rows keeps no autocast copy
    of a weight, where the model counted 0.02-0.03 MiB); its per_share stays nbytes_t (sigma_t =
    s), so a ratio LP that gives it rows still counts the split tensors. Without them every split
    tensor scales with s (sigma_t = s) and whole tensors are counted on every device."""
    if node.saved is None:
        return _unprobed_memory(node, any(l.is_shard for l in (output, *inputs)), n)
    fixed, per_share = [0.0] * n, [0.0] * n
    for t in node.saved:
        layout = _split_layout(t, inputs, output)
        if layout is False:
            fixed = [f + t.nbytes for f in fixed]
        elif layout is True or share_of is None or rule_shares is None:
            per_share = [p + t.nbytes for p in per_share]
        else:
            for i, (sigma, s) in enumerate(zip(share_of(saved_name(node, t), layout), rule_shares)):
                per_share[i] += t.nbytes * (sigma / s if s > 0 else 1.0)
    if rule_shares is not None:
        fixed = [f if s > 0 else 0.0 for f, s in zip(fixed, rule_shares)]
    return MemoryTerm(tuple(fixed), tuple(per_share))


def _unprobed_memory(node: Node, sharded: bool, n: int) -> MemoryTerm:
    zeros = (0.0,) * n
    if node.target in FREE_OPS or not any(o.requires_grad for o in node.outputs):
        return MemoryTerm(zeros, zeros)
    total = float(node.out_bytes)
    return MemoryTerm(zeros, (total,) * n) if sharded else MemoryTerm((total,) * n, zeros)
