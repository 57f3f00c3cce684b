"""The sharding-ratio LP (HAP, EuroSys'24, section 5), for a fixed program.

Variables
    r_i in [0, 1]     share of device i in every sharded dim (one ratio vector); devices of
                      one class of interchangeable devices (cost_models.device_classes)
                      share one variable, and i below ranges over classes with n_i devices
    t_j >= 0          epigraph of instruction group j (instructions with equal cost forms)
    u_o >= 0          epigraph of overlap o (an Overlap of cost_models.terms)
    v_f >= 0          epigraph of a distinct form f nested in an Overlap (one per distinct
                      form, shared by every place it appears)

An instruction's time is composed of forms `max_{i in D_f} (a_fi + b_fi s_i)`
(cost_models.terms), in shares s that are r_i itself (FLAT, a split over all devices), or the
sum of r over device i's node (NODE, a split across nodes only), or a constant at the current
ratios (FIXED, a split inside nodes only; NONE, no split). Series add up; an Overlap is the max
of its parts. Identical top-level forms (the same op in every layer) form one group j with
multiplicity m_j, identical Overlaps one o with multiplicity m_o; forms without a ratio
dependence are constants K. The LP is

    minimise    sum_j m_j t_j + sum_o m_o u_o + K
    subject to  sum_i n_i r_i = 1                                          (simplex)
                t_j >= a_ji + b_ji s_i(r)       for all compute groups j, i in D_j
                t_j >= a_ji + b_ji s_i(r)       for all communication groups j, i in D_j
                u_o >= E(p)                     for every part p of o
                v_f >= a_fi + b_fi s_i(r)       for every distinct nested form f, i in D_f
                sum_p f_pi + g_pi s_pi(r) <= capacity_i   for all devices i (memory)

where E(Series) = sum of E(parts), E(Overlap) = its u, E(form) = its v_f, and a constant form
its seconds (planner.step_cost writes the overlapped gradient sync this way). Every max becomes one
epigraph variable with one constraint per form and device: exact, since the objective is a
positive sum of maxima and sums of affine functions and presses each variable onto its
tightest constraint.

with the memory forms f + g r of parameters, gradients, optimizer state and activations
(cost_models.memory). Its optimum equals the program's predicted step time minimised over
continuous ratios; the planner rounds the ratios to shard lengths afterwards. Solved with
PuLP: HiGHS in-process by default (no temporary files), CBC as the fallback.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import pulp

from hetsynth.cost_models.device_classes import DeviceClasses
from hetsynth.cost_models.memory import GIB
from hetsynth.cost_models.terms import Cost, Form, Overlap, Series, ShareKind, Term, seconds
from hetsynth.instruction_set.kinds import Category


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
        _highs_banner_silenced()
        return highs, "HiGHS"
    return pulp.PULP_CBC_CMD(msg=False), "CBC"


@functools.cache
def _highs_banner_silenced() -> None:
    """highspy writes a two-line banner ("Running HiGHS ... Copyright ...") to the process's
    stdout at its first Highs() of the process, before any option (msg=False included) can be
    set; the first one is made here with file descriptor 1 on /dev/null, so that a plan's
    output has no solver banner in it."""
    import ctypes

    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
            ctypes.CDLL(None).fflush(None)  # the banner out of C's buffer while fd 1 is still /dev/null
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def top_level(terms: Sequence[Term]) -> tuple[list[Form], list[tuple[Overlap, int]]]:
    """The terms' forms outside any Overlap (a Series adds its parts), in order, and their
    Overlaps with multiplicity (the same object met again; by identity: hashing an Overlap
    would walk its whole tree)."""
    leaves: list[Form] = []
    overlaps: dict[int, list] = {}

    def add(c: Cost) -> None:
        if isinstance(c, Form):
            leaves.append(c)
        elif isinstance(c, Series):
            for p in c.parts:
                add(p)
        else:
            overlaps.setdefault(id(c), [c, 0])[1] += 1

    for t in terms:
        add(t.time)
    return leaves, [(o, n) for o, n in overlaps.values()]


def group_forms(leaves: Sequence[Form], compute: bool) -> tuple[Counter, float]:
    """Group ratio-dependent forms (compute, or not compute) by (kind, a, b, devices); sum the
    constant ones."""
    forms: Counter = Counter()
    constant = 0.0
    for f in leaves:
        if (f.category is Category.COMPUTE) != compute:
            continue
        if f.is_constant:
            constant += seconds(f)
        else:
            forms[(f.shares.kind, f.cost.a, f.cost.b, f.devices)] += 1
    return forms, constant


def share_exprs(r: list[pulp.LpVariable], classes: DeviceClasses) -> dict[str, list]:
    """s_i(r) per share kind: r_i, or the sum of r over class i's node (its composition)."""
    node = {t: pulp.lpSum(count * r[c] for c, count in t) for t in classes.node_types}
    return {ShareKind.FLAT: list(r), ShareKind.NODE: [node[t] for t in classes.node_of]}


def add_simplex(prob: pulp.LpProblem, r: list[pulp.LpVariable], classes: DeviceClasses) -> None:
    prob += pulp.lpSum(count * x for count, x in zip(classes.counts, r)) == 1, "simplex"


def _entries(n: int, nodes: Sequence[int] | None, classes: DeviceClasses | None) -> DeviceClasses:
    """The LP's entries: the given classes, else one per device (`nodes[i]`: device i's node)."""
    return classes if classes is not None else DeviceClasses.of_nodes(list(nodes) if nodes is not None else [0] * n)


def _bound(prob: pulp.LpProblem, t: pulp.LpVariable, s: dict[str, list], kind: ShareKind,
           a: Sequence[float], b: Sequence[float], devices: Sequence[int] | None, name: str) -> None:
    """t >= a_i + b_i s_i(r) for each entry i of `devices` (None: all)."""
    for i in range(len(a)) if devices is None else devices:
        prob += t >= a[i] + b[i] * s[kind][i], f"{name}_dev{i}"


def add_epigraphs(prob: pulp.LpProblem, s: dict[str, list], forms: Counter,
                  name: str) -> pulp.LpAffineExpression:
    """One epigraph variable per form; returns the weighted sum for the objective."""
    objective = []
    for j, ((kind, a, b, devices), count) in enumerate(forms.items()):
        t = prob.add_variable(f"{name}_{j}", lowBound=0)
        _bound(prob, t, s, kind, a, b, devices, f"{name}_{j}")
        objective.append(count * t)
    return pulp.lpSum(objective)


class _Lowering:
    """Epigraphs of Overlaps and of the forms nested in them (see the module docstring). A form
    met again (the same op in every layer; a backward segment that several branches of an
    overlapped gradient sync share) reuses its variable: v_f bounds the same max of affine
    functions wherever it appears, always with a positive coefficient, so sharing it is exact
    and keeps the LP as small as the number of distinct forms."""

    def __init__(self, prob: pulp.LpProblem, s: dict[str, list]) -> None:
        self.prob, self.s, self.count = prob, s, 0
        self.forms: dict[tuple, pulp.LpVariable] = {}
        self.overlaps: dict[int, pulp.LpVariable] = {}
        self.series: dict[int, pulp.LpAffineExpression] = {}

    def _variable(self, prefix: str) -> tuple[pulp.LpVariable, str]:
        name = f"{prefix}_{self.count}"
        self.count += 1
        return self.prob.add_variable(name, lowBound=0), name

    def expr(self, c: Cost) -> pulp.LpAffineExpression | float:
        """E(c): an affine expression bounding c from above, tight at the optimum."""
        if isinstance(c, Series):  # a Series shared by several branches is summed once
            if id(c) not in self.series:
                self.series[id(c)] = pulp.lpSum(self.expr(p) for p in c.parts)
            return self.series[id(c)]
        if isinstance(c, Form):
            return seconds(c) if c.is_constant else self._form(c)
        if id(c) not in self.overlaps:
            v, name = self._variable("overlap")
            for k, p in enumerate(c.parts):
                self.prob += v >= self.expr(p), f"{name}_{k}"
            self.overlaps[id(c)] = v
        return self.overlaps[id(c)]

    def _form(self, f: Form) -> pulp.LpVariable:
        key = (f.shares.kind, f.cost.a, f.cost.b, f.devices)
        if key not in self.forms:
            v, name = self._variable("form")
            _bound(self.prob, v, self.s, f.shares.kind, f.cost.a, f.cost.b, f.devices, name)
            self.forms[key] = v
        return self.forms[key]


def add_overlaps(prob: pulp.LpProblem, s: dict[str, list],
                 overlaps: Sequence[tuple[Overlap, int]]) -> pulp.LpAffineExpression:
    """One epigraph variable per distinct Overlap; returns the weighted sum for the objective."""
    lowering = _Lowering(prob, s)
    return pulp.lpSum(count * lowering.expr(o) for o, count in overlaps)


def memory_forms(terms: Sequence[Term], n: int) -> tuple[list[float], dict[str, list[float]]]:
    """Per device: constant bytes, and bytes per unit share for each ratio-dependent kind."""
    fixed = [0.0] * n
    per_share = {ShareKind.FLAT: [0.0] * n, ShareKind.NODE: [0.0] * n}
    for t in terms:
        if t.memory is None:
            continue
        at = t.memory_at
        assert at is not None, "a term with memory says where it is evaluated"
        for i in range(n):
            fixed[i] += t.memory.fixed[i]
            if at.kind in per_share:
                per_share[at.kind][i] += t.memory.per_share[i]
            else:
                fixed[i] += t.memory.per_share[i] * at.values[i]
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
    leaves, overlaps = top_level(terms)
    compute_forms, compute_const = group_forms(leaves, compute=True)
    comm_forms, comm_const = group_forms(leaves, compute=False)
    add_simplex(prob, r, entries)
    objective = add_epigraphs(prob, s, compute_forms, "compute") + add_epigraphs(prob, s, comm_forms, "comm")
    if overlaps:
        objective += add_overlaps(prob, s, overlaps)
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
