"""Cost of a finished program: one Term per instruction, memory per device, prediction.

Every instruction of a program contributes a `Term`: its time as a LinearCost, the per-device
shares it is evaluated at (the rounded shard lengths at the problem's ratios), how those
shares depend on the ratios for the LP (`lp_kind`), whether it is compute or communication,
and its memory. The same terms give

- the prediction of a plan: step time = sum over instructions of the max over devices, plus
  the step's scalar all-reduces (step_term); per-device compute, communication and memory
  (per class of interchangeable devices, planner.problem, expanded to every device);
- the sharding-ratio LP (planner.ratios), which replaces the shares by functions of the
  ratio variables r: "flat" s_i = r_i, "node" s_i = sum of r over device i's node, "fixed"
  (shares inside one node only: kept at their current value), "none" (no split).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from cost_models.linear_cost import LinearCost
from cost_models.memory import GIB, MemoryTerm, activation_memory, param_memory
from instruction_set.layouts import axes, is_shard, is_two_level
from instruction_set.plan import DevicePrediction, Prediction
from instruction_set.program import Instruction
from planner.problem import Problem, rule_splits
from planner.sfb import sfb_cost


@dataclass(frozen=True)
class Term:
    time: LinearCost
    shares: tuple[float, ...]
    lp_kind: str
    is_compute: bool
    memory: MemoryTerm | None = None


def lp_kind(layouts: Sequence[str]) -> str:
    """How the shares of a split across these layouts depend on the ratios."""
    split = [l for l in layouts if is_shard(l)]
    flat = any(not is_two_level(l) for l in split)
    outer = any(is_two_level(l) and is_shard(axes(l)[0]) for l in split)
    inner = any(is_two_level(l) and is_shard(axes(l)[1]) for l in split)
    if flat or (outer and inner):
        return "flat"
    return "node" if outer else ("fixed" if inner else "none")


def _rule_index(pb: Problem, ins: Instruction) -> int:
    for i, rule in enumerate(pb.rules[ins.node]):
        if rule.inputs == tuple(ins.inputs) and rule.output == ins.layout:
            return i
    raise ValueError(f"instruction {ins.describe()} matches no rule of {ins.node}")


def _compute_term(pb: Problem, ins: Instruction) -> Term:
    node = pb.graph.node(ins.node)
    ri = _rule_index(pb, ins)
    rule = pb.rules[node.name][ri]
    return Term(pb.compute_linear(node, ri), pb.rule_shares(node, rule), lp_kind((rule.output, *rule.inputs)),
                True, activation_memory(node, rule_splits(rule), pb.width))


def _param_term(pb: Problem, ins: Instruction) -> Term:
    mem = param_memory(pb.meta(ins.tensor).nbytes, is_shard(ins.layout), pb.width)
    update = pb.update_linear(ins.tensor, ins.layout)
    return Term(update, pb.shares(ins.tensor, ins.layout), lp_kind([ins.layout]), True, mem)


def _sync_term(pb: Problem, ins: Instruction) -> Term:
    """Backward gradient all-reduce of a replicated (or node-replicated) parameter."""
    nbytes = pb.meta(ins.tensor).nbytes
    if ins.axis == "outer":
        nbytes *= max(pb.shares(ins.tensor, ins.layout))
    cost = pb.comm.bucketed(ins.variant, nbytes, ins.axis)
    return Term(cost, (1.0,) * pb.width, "none", False)


def _collective_term(pb: Problem, ins: Instruction) -> Term:
    shares, nbytes = pb.axis_shares(ins.tensor, ins.src, ins.layout, ins.axis)
    cost = pb.comm.with_adjoint(ins.kind, ins.variant, nbytes, pb.requires_grad(ins.tensor), ins.axis, shares)
    kind = {"all": lp_kind([ins.src, ins.layout]), "inner": "fixed", "outer": "node"}[ins.axis]
    return Term(cost, shares, kind, False)


def instruction_term(pb: Problem, ins: Instruction, x_layouts: dict[str, str]) -> Term | None:
    """The Term of one instruction (None for free ones)."""
    if ins.kind == "compute":
        return _compute_term(pb, ins)
    if ins.kind == "param":
        return _param_term(pb, ins)
    if ins.kind == "sfb":
        x = pb.graph.node(ins.node).inputs[0]
        layout = x_layouts[ins.node]
        shares = pb.shares(x, layout)
        return Term(sfb_cost(pb, ins.tensor, ins.node, ins.variant, shares), shares, "flat", False)
    if ins.kind == "all_reduce" and ins.phase == "backward":
        return _sync_term(pb, ins)
    if ins.kind in ("input", "buffer", "slice", "partial"):
        return None
    return _collective_term(pb, ins)


STEP_SCALARS = 2  # all-reduces of one scalar per step: the global gradient norm, the loss


def step_term(pb: Problem) -> Term:
    """What every step adds to any program: the runtime's scalar all-reduces over all
    devices (runtime.train: global-norm clipping and the reported loss), latency-bound."""
    one = pb.comm.cost("all_reduce", "ring", 8.0).at((1.0 / pb.width,) * pb.width)
    return Term(LinearCost.constant(STEP_SCALARS * one, pb.width), (1.0,) * pb.width, "none", False)


def first_input_layouts(program: Sequence[Instruction]) -> dict[str, str]:
    """Op -> the layout its first input is read in (SFB's costs depend on it)."""
    return {i.node: i.inputs[0] for i in program if i.kind == "compute" and i.inputs}


def program_terms(pb: Problem, program: Sequence[Instruction]) -> list[Term]:
    x_layouts = first_input_layouts(program)
    terms = [instruction_term(pb, ins, x_layouts) for ins in program]
    return [t for t in terms if t is not None] + [step_term(pb)]


def step_time(terms: Sequence[Term]) -> float:
    return sum(t.time.at(t.shares) for t in terms)


def memory_bytes(n: int, terms: Sequence[Term]) -> list[float]:
    total = [0.0] * n
    for t in terms:
        if t.memory is not None:
            for i, b in enumerate(t.memory.per_device(t.shares)):
                total[i] += b
    return total


def predict(pb: Problem, terms: Sequence[Term]) -> Prediction:
    """Step time and per-device compute, communication and memory at the problem's ratios."""
    compute = [0.0] * pb.width
    comm = 0.0
    for t in terms:
        if t.is_compute:
            for i, c in enumerate(t.time.per_device(t.shares)):
                compute[i] += c
        else:
            comm += t.time.at(t.shares)
    memory = memory_bytes(pb.width, terms)
    caps = [k.memory_gib for k in pb.kinds]
    of = pb.devices.of_rank
    devices = tuple(
        DevicePrediction(name=d.name, kind=d.kind, ratio=pb.ratios[i], compute_s=compute[of[i]],
                         communication_s=comm, memory_gib=memory[of[i]] / GIB, memory_capacity_gib=caps[of[i]])
        for i, d in enumerate(pb.cluster.devices))
    total = step_time(terms)
    return Prediction(step_time_s=total, compute_s=total - comm, communication_s=comm,
                      fits=all(m / GIB <= c for m, c in zip(memory, caps)), devices=devices)
