"""The sharding-ratio LP (HAP, EuroSys'24, section 5), for a fixed program.

Variables
    r_i in [0, 1]     share of device i in every sharded dim (one ratio vector); devices of
                      one class of interchangeable devices (cost_models.device_classes)
                      share one variable, and i below ranges over classes with n_i devices
    t_j >= 0          epigraph of instruction group j (instructions with equal cost forms)

Every instruction's time is `max_i (a_ji + b_ji s_i)` (cost_models.linear_cost) in shares s
that are r_i itself (a split over all devices), or the sum of r over device i's node
(`node`, a split across nodes only), or a constant at the current ratios (a split inside
nodes only, `fixed`). Identical forms (the same op in every layer) form one group j with
multiplicity m_j; forms without a ratio dependence are constants K. The LP is

    minimise    sum_j m_j t_j + K
    subject to  sum_i n_i r_i = 1                                          (simplex)
                t_j >= a_ji + b_ji s_i(r)       for all compute groups j, devices i
                t_j >= a_ji + b_ji s_i(r)       for all communication groups j, devices i
                sum_p f_pi + g_pi s_pi(r) <= capacity_i   for all devices i (memory)

with the memory forms f + g r of parameters, gradients, optimizer state and activations
(cost_models.memory). Its optimum equals the program's predicted step time minimised over
continuous ratios; the planner rounds the ratios to shard lengths afterwards. Solved with
PuLP: HiGHS in-process by default (no temporary files), CBC as the fallback.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import pulp

from cost_models.device_classes import DeviceClasses
from cost_models.memory import GIB
from planner.evaluate import Term

Form = tuple[tuple[float, ...], tuple[float, ...]]


class MemoryInfeasible(ValueError):
    """No ratios fit the program in memory."""


@dataclass(frozen=True)
class RatioSolution:
    ratios: tuple[float, ...]
    objective_s: float
    seconds: float
    solver: str


def _solver() -> tuple[pulp.LpSolver, str]:
    highs = pulp.HiGHS(msg=False)
    if highs.available():
        return highs, "HiGHS"
    return pulp.PULP_CBC_CMD(msg=False), "CBC"


def group_forms(terms: Sequence[Term], compute: bool) -> tuple[Counter, float]:
    """Group ratio-dependent forms of one kind by (lp_kind, a, b); sum the constant ones."""
    forms: Counter = Counter()
    constant = 0.0
    for t in terms:
        if t.is_compute != compute:
            continue
        if t.lp_kind in ("none", "fixed") or t.time.is_constant:
            constant += t.time.at(t.shares)
        else:
            forms[(t.lp_kind, t.time.a, t.time.b)] += 1
    return forms, constant


def share_exprs(r: list[pulp.LpVariable], classes: DeviceClasses) -> dict[str, list]:
    """s_i(r) per lp kind: r_i, or the sum of r over class i's node (its composition)."""
    node = {t: pulp.lpSum(count * r[c] for c, count in t) for t in classes.node_types}
    return {"flat": list(r), "node": [node[t] for t in classes.node_of]}


def add_simplex(prob: pulp.LpProblem, r: list[pulp.LpVariable], classes: DeviceClasses) -> None:
    prob += pulp.lpSum(count * x for count, x in zip(classes.counts, r)) == 1, "simplex"


def _entries(n: int, nodes: Sequence[int] | None, classes: DeviceClasses | None) -> DeviceClasses:
    """The LP's entries: the given classes, else one per device (`nodes[i]`: device i's node)."""
    return classes if classes is not None else DeviceClasses.of_nodes(list(nodes) if nodes is not None else [0] * n)


def add_epigraphs(prob: pulp.LpProblem, s: dict[str, list], forms: Counter,
                  name: str) -> pulp.LpAffineExpression:
    """One epigraph variable per form; returns the weighted sum for the objective."""
    objective = []
    for j, ((kind, a, b), count) in enumerate(forms.items()):
        t = prob.add_variable(f"{name}_{j}", lowBound=0)
        for i, (ai, bi) in enumerate(zip(a, b)):
            prob += t >= ai + bi * s[kind][i], f"{name}_{j}_dev{i}"
        objective.append(count * t)
    return pulp.lpSum(objective)


def memory_forms(terms: Sequence[Term], n: int) -> tuple[list[float], dict[str, list[float]]]:
    """Per device: constant bytes, and bytes per unit share for each ratio-dependent kind."""
    fixed = [0.0] * n
    per_share = {"flat": [0.0] * n, "node": [0.0] * n}
    for t in terms:
        if t.memory is None:
            continue
        for i in range(n):
            fixed[i] += t.memory.fixed[i]
            if t.lp_kind in per_share:
                per_share[t.lp_kind][i] += t.memory.per_share[i]
            else:
                fixed[i] += t.memory.per_share[i] * t.shares[i]
    return fixed, per_share


def memory_expr(terms: Sequence[Term], s: dict[str, list], n: int) -> list:
    fixed, per_share = memory_forms(terms, n)
    return [fixed[i] + sum(per_share[k][i] * s[k][i] for k in per_share) for i in range(n)]


def add_memory(prob: pulp.LpProblem, s: dict[str, list], terms: Sequence[Term],
               capacities_gib: Sequence[float]) -> None:
    for i, (mem, cap) in enumerate(zip(memory_expr(terms, s, len(capacities_gib)), capacities_gib)):
        prob += mem <= cap * GIB, f"memory_dev{i}"


def solve_ratios(terms: Sequence[Term], capacities_gib: Sequence[float], *,
                 nodes: Sequence[int] | None = None, classes: DeviceClasses | None = None,
                 min_ratio: float = 0.0) -> RatioSolution:
    """Optimal ratios for the program whose terms are given (raises MemoryInfeasible), one per
    entry of the terms: per class of `classes`, or per device (`nodes[i]` device i's node, for
    terms split across nodes only)."""
    start = time.perf_counter()
    n = len(capacities_gib)
    entries = _entries(n, nodes, classes)
    prob = pulp.LpProblem("sharding_ratios", pulp.LpMinimize)
    r = [prob.add_variable(f"r_{i}", lowBound=min_ratio, upBound=1) for i in range(n)]
    s = share_exprs(r, entries)
    compute_forms, compute_const = group_forms(terms, compute=True)
    comm_forms, comm_const = group_forms(terms, compute=False)
    add_simplex(prob, r, entries)
    objective = add_epigraphs(prob, s, compute_forms, "compute") + add_epigraphs(prob, s, comm_forms, "comm")
    prob += objective + compute_const + comm_const
    add_memory(prob, s, terms, capacities_gib)
    solver, name = _solver()
    prob.solve(solver)
    status = pulp.LpStatus[prob.status]
    if status != "Optimal":
        raise MemoryInfeasible(f"sharding-ratio LP is {status.lower()}")
    ratios = tuple(max(0.0, float(v.value() or 0.0)) for v in r)
    total = sum(count * x for count, x in zip(entries.counts, ratios))
    return RatioSolution(tuple(x / total for x in ratios), float(pulp.value(prob.objective)),
                         time.perf_counter() - start, name)


def least_memory_overflow(terms: Sequence[Term], capacities_gib: Sequence[float], *,
                          nodes: Sequence[int] | None = None,
                          classes: DeviceClasses | None = None) -> tuple[tuple[float, ...], list[float]]:
    """Ratios minimising the largest memory overflow, and each entry's overflow in GiB."""
    n = len(capacities_gib)
    entries = _entries(n, nodes, classes)
    prob = pulp.LpProblem("memory_overflow", pulp.LpMinimize)
    r = [prob.add_variable(f"r_{i}", lowBound=0, upBound=1) for i in range(n)]
    z = prob.add_variable("z")
    add_simplex(prob, r, entries)
    s = share_exprs(r, entries)
    mem = memory_expr(terms, s, n)
    for i, cap in enumerate(capacities_gib):
        prob += mem[i] / GIB - cap <= z, f"overflow_dev{i}"
    prob += z
    prob.solve(_solver()[0])
    over = [float(pulp.value(mem[i])) / GIB - cap for i, cap in enumerate(capacities_gib)]
    return tuple(max(0.0, float(v.value() or 0.0)) for v in r), over
