"""Cost of a finished program: one Term per instruction, memory per device, prediction.

Every instruction of a program contributes a `Term` (cost_models.terms): its time as forms
that compose, each a LinearCost at the per-device shares it is evaluated at (the rounded
shard lengths at the problem's ratios) with how those shares depend on the ratios for the LP
(its ShareKind) and its category (compute or communication), and its memory. Today every
instruction is one form (`Term.leaf`). The same terms give

- the prediction of a plan: step time = sum over the step's terms of their seconds (for a
  leaf, the max over devices; planner.step_cost composes the instructions' terms with the
  gradient sync overlapped with the backward pass); per-device compute
  (`busy`), exposed communication and memory (per class of interchangeable devices,
  planner.problem, expanded to every device);
- the sharding-ratio LP (planner.ratios), which replaces the shares by functions of the
  ratio variables r: "flat" s_i = r_i, "node" s_i = sum of r over device i's node, "fixed"
  (shares inside one node only: kept at their current value), "none" (no split).
"""

from __future__ import annotations

from typing import Callable, Sequence

from hetsynth.cost_models.memory import GIB, activation_memory, param_memory, zero_memory
from hetsynth.cost_models.terms import Form, Series, Shares, ShareKind, Term, busy, exposed, seconds
from hetsynth.instruction_set.kinds import Category, Implementations, Phase
from hetsynth.instruction_set.layouts import Layout
from hetsynth.instruction_set.plan import DevicePrediction, Prediction
from hetsynth.instruction_set.program import COLLECTIVES, Instruction
from hetsynth.instruction_set.training_state import SHARDED_STATES, TrainingState
from hetsynth.planner.problem import Problem
from hetsynth.planner.sfb import sfb_cost


def share_kind(layouts: Sequence[Layout]) -> ShareKind:
    """How the shares of a split across these layouts depend on the ratios."""
    split = [l for l in layouts if l.is_shard]
    flat = any(not l.is_two_level for l in split)
    outer = any(l.is_two_level and l.outer.is_shard for l in split)
    inner = any(l.is_two_level and l.inner.is_shard for l in split)
    if flat or (outer and inner):
        return ShareKind.FLAT
    return ShareKind.NODE if outer else (ShareKind.FIXED if inner else ShareKind.NONE)


def _rule_index(pb: Problem, ins: Instruction) -> int:
    for i, rule in enumerate(pb.rules[ins.node]):
        if rule.inputs == tuple(ins.inputs) and rule.output == ins.layout:
            return i
    raise ValueError(f"instruction {ins.describe()} matches no rule of {ins.node}")


TermFn = Callable[[Problem, Instruction, dict[str, Layout]], "Term | None"]
TERMS: Implementations[TermFn] = Implementations("cost term")


@TERMS.implements("compute")
def _compute_term(pb: Problem, ins: Instruction, x_layouts: dict[str, Layout]) -> Term:
    node = pb.graph.node(ins.node)
    ri = _rule_index(pb, ins)
    rule = pb.rules[node.name][ri]
    work = [rule.inputs[i] for i in rule.work_inputs] or [rule.output, *rule.inputs]
    shares = Shares(pb.rule_shares(node, rule), share_kind(work))
    term = Term.leaf(pb.compute_linear(node, ri), shares, Category.COMPUTE,
                     activation_memory(node, rule.inputs, rule.output, pb.width, shares.values, pb.shares))
    inside = pb.op_communication(node, rule)
    if inside is None:
        return term
    cost, at, axis = inside
    kind = {"all": share_kind([rule.inputs[0]]), "inner": ShareKind.FIXED}[axis]
    return Term(Series((term.time, Form(cost, Shares(at, kind), Category.COMMUNICATION))), term.memory, term.memory_at)


@TERMS.implements("param")
def _param_term(pb: Problem, ins: Instruction, x_layouts: dict[str, Layout]) -> Term:
    if ins.state in SHARDED_STATES:  # the update on the device's rows; state at q (held fixed in the ratio LP)
        stage = {TrainingState.ZERO1: 1, TrainingState.ZERO2: 2, TrainingState.ZERO3: 3}[ins.state]
        return Term.leaf(pb.update_rows_linear(ins.tensor), Shares(pb.state_shares, ShareKind.FIXED), Category.COMPUTE,
                         zero_memory(pb.meta(ins.tensor).nbytes, pb.width, stage))
    mem = param_memory(pb.meta(ins.tensor).nbytes, ins.layout.is_shard, pb.width)
    update = pb.update_linear(ins.tensor, ins.layout)
    return Term.leaf(update, Shares(pb.shares(ins.tensor, ins.layout), share_kind([ins.layout])),
                     Category.COMPUTE, mem)


@TERMS.implements("all_reduce", phase=Phase.BACKWARD)
def _sync_term(pb: Problem, ins: Instruction, x_layouts: dict[str, Layout]) -> Term:
    """Backward gradient all-reduce of a replicated (or node-replicated) parameter."""
    nbytes = pb.meta(ins.tensor).nbytes * pb.graph.grad_reduce_scale
    if ins.axis == "outer":
        nbytes *= max(pb.shares(ins.tensor, ins.layout))
    cost = pb.comm.bucketed(ins.variant, nbytes, ins.axis)
    return Term.leaf(cost, Shares((1.0,) * pb.width, ShareKind.NONE), Category.COMMUNICATION)


@TERMS.implements(*COLLECTIVES)
def _collective_term(pb: Problem, ins: Instruction, x_layouts: dict[str, Layout]) -> Term:
    shares, nbytes = pb.axis_shares(ins.tensor, ins.src, ins.layout, ins.axis)
    cost = pb.comm.with_adjoint(ins.kind, ins.variant, nbytes, pb.requires_grad(ins.tensor), ins.axis, shares)
    kind = {"all": share_kind([ins.src, ins.layout]), "inner": ShareKind.FIXED, "outer": ShareKind.NODE}[ins.axis]
    return Term.leaf(cost, Shares(shares, kind), Category.COMMUNICATION)


@TERMS.implements("sfb", phase=Phase.BACKWARD)
def _sfb_term(pb: Problem, ins: Instruction, x_layouts: dict[str, Layout]) -> Term:
    """The factors' all-gathers (planner.sfb), counted as communication."""
    x = pb.graph.node(ins.node).inputs[0]
    shares = pb.shares(x, x_layouts[ins.node])
    cost = sfb_cost(pb, ins.tensor, ins.node, ins.variant, shares)
    return Term.leaf(cost, Shares(shares, ShareKind.FLAT), Category.COMMUNICATION)


@TERMS.implements("input", "buffer", "slice", "partial")
def _free(pb: Problem, ins: Instruction, x_layouts: dict[str, Layout]) -> None:
    """No time: the batch and buffers are placed before the step; slice and partial are local."""
    return None


def instruction_term(pb: Problem, ins: Instruction, x_layouts: dict[str, Layout]) -> Term | None:
    """The Term of one instruction (None for free ones), by its kind's registered cost term."""
    return TERMS.get(ins.kind, phase=ins.phase)(pb, ins, x_layouts)


def first_input_layouts(program: Sequence[Instruction]) -> dict[str, Layout]:
    """Op -> the layout its first input is read in (SFB's costs depend on it)."""
    return {i.node: i.inputs[0] for i in program if i.runs_op and i.inputs}


def step_time(terms: Sequence[Term]) -> float:
    return sum(seconds(t.time) for t in terms)


def memory_bytes(n: int, terms: Sequence[Term], part: str | None = None) -> list[float]:
    """Bytes per device (class) of the terms' memory, of one part (state, saved) or all."""
    total = [0.0] * n
    for t in terms:
        if t.memory is not None and part in (None, t.memory.part):
            assert t.memory_at is not None, "a term with memory says where it is evaluated"
            for i, b in enumerate(t.memory.per_device(t.memory_at.values)):
                total[i] += b
    return total


def predict(pb: Problem, terms: Sequence[Term]) -> Prediction:
    """Step time and per-device compute, communication and memory at the problem's ratios."""
    compute = [0.0] * pb.width
    comm = 0.0
    for t in terms:
        for i, c in enumerate(busy(t.time, Category.COMPUTE, pb.width)):
            compute[i] += c
        comm += exposed(t.time, Category.COMMUNICATION)
    memory = memory_bytes(pb.width, terms)
    state, saved = memory_bytes(pb.width, terms, "state"), memory_bytes(pb.width, terms, "saved")
    working = memory_bytes(pb.width, terms, "working")
    caps = [k.memory_gib for k in pb.kinds]
    of = pb.devices.of_rank
    devices = tuple(
        DevicePrediction(name=d.name, kind=d.kind, ratio=pb.ratios[i], compute_s=compute[of[i]],
                         communication_s=comm, memory_gib=memory[of[i]] / GIB, memory_capacity_gib=caps[of[i]],
                         state_gib=state[of[i]] / GIB, saved_gib=saved[of[i]] / GIB, working_gib=working[of[i]] / GIB)
        for i, d in enumerate(pb.cluster.devices))
    total = step_time(terms)
    return Prediction(step_time_s=total, compute_s=total - comm, communication_s=comm,
                      fits=all(m / GIB <= c for m, c in zip(memory, caps)), devices=devices)
