"""Cost of a finished program: one LinearCost per instruction, memory per device, prediction.

Every instruction of a program contributes a `Term`: its time as a LinearCost in the shares of
one sharded layout (`share_key`, None when it does not depend on shares), its kind (compute
or communication), and its memory. The same terms give

- the prediction of a plan: shares are the rounded shard lengths of `share_key` at the
  plan's ratios (step time = sum of max over devices per instruction; memory per device);
- the sharding-ratio LP (planner.ratios): shares are the ratio variables themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from cost_models.linear_cost import LinearCost
from cost_models.memory import GIB, MemoryTerm, activation_memory, param_memory
from instruction_set.layouts import is_shard
from instruction_set.plan import DevicePrediction, Prediction
from instruction_set.program import Instruction
from planner.problem import Problem
from planner.sfb import sfb_cost

ShareKey = tuple[str, str] | None


@dataclass(frozen=True)
class Term:
    time: LinearCost
    share_key: ShareKey
    is_compute: bool
    memory: MemoryTerm | None = None


def _rule_index(pb: Problem, ins: Instruction) -> int:
    for i, rule in enumerate(pb.rules[ins.node]):
        if rule.inputs == tuple(ins.inputs) and rule.output == ins.layout:
            return i
    raise ValueError(f"instruction {ins.describe()} matches no rule of {ins.node}")


def _compute_term(pb: Problem, ins: Instruction) -> Term:
    node = pb.graph.node(ins.node)
    ri = _rule_index(pb, ins)
    rule = pb.rules[node.name][ri]
    sharded = is_shard(rule.output) or any(is_shard(l) for l in rule.inputs)
    key = next(((t, l) for t, l in [(node.name, rule.output), *zip(node.inputs, rule.inputs)]
                if is_shard(l)), None)
    return Term(pb.compute_linear(node, ri), key, True, activation_memory(node, sharded, pb.n))


def _sfb_term(pb: Problem, ins: Instruction, x_layout: str) -> Term:
    x = pb.graph.node(ins.node).inputs[0]
    return Term(sfb_cost(pb, ins.tensor, ins.node, ins.variant), (x, x_layout), False)


def instruction_term(pb: Problem, ins: Instruction, program_layouts: dict[str, str]) -> Term | None:
    """The Term of one instruction (None for free ones)."""
    n = pb.n
    if ins.kind == "compute":
        return _compute_term(pb, ins)
    if ins.kind == "param":
        mem = param_memory(pb.meta(ins.tensor).nbytes, is_shard(ins.layout), n)
        return Term(LinearCost.zero(n), (ins.tensor, ins.layout) if is_shard(ins.layout) else None,
                    False, mem)
    if ins.kind == "sfb":
        return _sfb_term(pb, ins, program_layouts[ins.node])
    if ins.kind == "all_reduce" and ins.phase == "backward":
        return Term(pb.comm.gradient_allreduce(pb.meta(ins.tensor).nbytes), None, False)
    if ins.kind in ("input", "buffer", "slice", "partial"):
        return None
    meta = pb.meta(ins.tensor)
    sharded = ins.layout if is_shard(ins.layout) else ins.src
    key = (ins.tensor, sharded) if is_shard(sharded) else None
    return Term(pb.comm.with_adjoint(ins.kind, ins.variant, meta.nbytes, meta.requires_grad), key, False)


def program_terms(pb: Problem, program: Sequence[Instruction]) -> list[Term]:
    x_layouts = {i.node: i.inputs[0] for i in program if i.kind == "compute" and i.inputs}
    terms = [instruction_term(pb, ins, x_layouts) for ins in program]
    return [t for t in terms if t is not None]


def shares_of(pb: Problem, key: ShareKey) -> tuple[float, ...]:
    return pb.shares(*key) if key is not None else (1.0,) * pb.n


def step_time(pb: Problem, terms: Sequence[Term]) -> float:
    return sum(t.time.at(shares_of(pb, t.share_key)) for t in terms)


def memory_bytes(pb: Problem, terms: Sequence[Term]) -> list[float]:
    total = [0.0] * pb.n
    for t in terms:
        if t.memory is not None:
            for i, b in enumerate(t.memory.per_device(shares_of(pb, t.share_key))):
                total[i] += b
    return total


def predict(pb: Problem, terms: Sequence[Term]) -> Prediction:
    """Step time and per-device compute, communication and memory at the problem's ratios."""
    compute = [0.0] * pb.n
    comm = 0.0
    for t in terms:
        shares = shares_of(pb, t.share_key)
        if t.is_compute:
            for i, c in enumerate(t.time.per_device(shares)):
                compute[i] += c
        else:
            comm += t.time.at(shares)
    memory = memory_bytes(pb, terms)
    caps = [k.memory_gib for k in pb.kinds]
    devices = tuple(
        DevicePrediction(name=d.name, kind=d.kind, ratio=pb.ratios[i], compute_s=compute[i],
                         communication_s=comm, memory_gib=memory[i] / GIB, memory_capacity_gib=caps[i])
        for i, d in enumerate(pb.cluster.devices))
    total = step_time(pb, terms)
    return Prediction(step_time_s=total, compute_s=total - comm, communication_s=comm,
                      fits=all(m / GIB <= c for m, c in zip(memory, caps)), devices=devices)
