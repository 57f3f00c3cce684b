"""ZeRO-1 and ZeRO-2 as planning decisions: which parameters shard their optimizer state (and
gradient), and the state ratios q that size each device's rows from its free memory and speed.

A ZeRO-1 parameter (instruction_set.training_state) keeps its parameter and gradient whole
and holds only its rows' optimizer state; the gradient is all-reduced as before, each device
updates its rows, and one all-gather after the step brings every device the new rows. A
ZeRO-2 parameter also holds only its rows' gradient: the gradient is reduce-scattered onto
the rows (instruction_set.sync's reduce_scatter buckets) instead of all-reduced. A ZeRO-3
parameter holds only its rows of the parameter too: it is all-gathered at each use, again in
the backward, and its gradient reduce-scattered onto the rows there (runtime.zero3); its
candidates are those read by plain compute instructions only (no SFB, no fused
collective-matmul, no conversion of the parameter). The candidates are the trained parameters stored replicated over every device (layout R): their
gradient is all-reduced over all devices, so any device can own any row.

The state LP, at fixed compute ratios r and program (classes c of interchangeable devices,
n_c devices each; per device of class c: M_c the bytes of everything but the sharded state,
S the sharded state bytes (OPTIMIZER_COPIES - 2 copies of the parameters under ZeRO-1, - 1
under ZeRO-2, all of them under ZeRO-3), U_c the seconds to update all ZeRO parameters, G the
padded collectives' seconds at even q: the post-step all-gather's, plus under ZeRO-2 the
gradients' reduce-scatter's, under ZeRO-3 k uses' two all-gathers and one reduce-scatter;
g devices):

    minimise    t + G g m
    subject to  sum_c n_c q_c = 1,   q_c >= 0
                t >= U_c q_c                          (the update: every device its own rows)
                m >= q_c                              (the padded all-gather pays the largest share)
                M_c + S q_c <= capacity_c             (memory)

then, among the solutions within 0.1% of that time, the one that leaves every device the
same fraction of its memory free (minimise mu s.t. M_c + S q_c <= mu capacity_c): so the
state follows the memories where time does not decide (equal speeds), and the rows move off
a device that memory binds. That is the time-first order. The memory-first order swaps the
two: first mu* = min mu over the same simplex, which puts

    q_c = (mu* capacity_c - M_c) / S        (clipped at 0 where M_c alone exceeds mu* capacity_c)

so a device with more free memory (capacity_c - M_c) holds more rows; then, within
mu <= mu* (1 + 0.1%), the fastest q (t + G g m as above), which is where the speeds enter
(the update term U_c q_c, and the padded collectives at the largest share m: rows that
follow memory are uneven, and the padded collectives pay for it). The time-first optimum
sits at even rows whenever the padded collectives dominate the update, whatever the
memories, which is why the planner tries the memory-first rows first where memory binds
(planner.planner._fit_memory) and keeps the time-first ones for when nothing fits so. The
full prediction (planner.step_cost) then costs the program at the rounded rows, with the
variant (padded, grouped, ring) cheapest there. q is one ratio per class (the cost model's entries), each device of a class
gets it; the rows per parameter come from q by largest remainder (training_state.state_rows).
"""

from __future__ import annotations

import logging
from typing import Sequence

import pulp

from hetsynth.cost_models.memory import OPTIMIZER_COPIES
from hetsynth.instruction_set.layouts import R
from hetsynth.instruction_set.program import Instruction
from hetsynth.instruction_set.training_state import SHARDED_STATES, StateShards, TrainingState, state_rows
from hetsynth.planner.evaluate import memory_bytes
from hetsynth.planner.problem import Problem
from hetsynth.planner.ratios import MemoryInfeasible, _solver
from hetsynth.planner.step_cost import program_terms, state_gather_variant, state_scatter_variant, zero3_uses

log = logging.getLogger(__name__)


def zero_candidates(pb: Problem, program: Sequence[Instruction]) -> list[str]:
    """The trained parameters stored whole on every device, with a dim 0 to shard in rows."""
    return [i.tensor for i in program if i.kind == "param" and i.layout is R and pb.requires_grad(i.tensor)
            and pb.meta(i.tensor).shape]


def zero3_candidates(pb: Problem, program: Sequence[Instruction]) -> list[str]:
    """zero_candidates read by plain compute instructions only (runtime.zero3 gathers there)."""
    other = {i.tensor for i in program if i.kind not in ("param", "compute", "all_reduce")}
    other |= {t for i in program if i.runs_op and i.kind != "compute" for t in pb.graph.node(i.node).inputs}
    return [t for t in zero_candidates(pb, program) if t not in other]


def zero2_candidates(pb: Problem, program: Sequence[Instruction]) -> list[str]:
    """zero_candidates whose gradient the program syncs with a backward all-reduce (the
    instruction a ZeRO-2 bucket turns into a reduce-scatter onto the rows); a gradient synced
    otherwise (sufficient factors broadcast, SFB: whole on every rank) keeps its state whole."""
    reduced = {i.tensor for i in program if i.kind == "all_reduce" and i.phase == "backward"}
    return [t for t in zero_candidates(pb, program) if t in reduced]


def stage_candidates(pb: Problem, program: Sequence[Instruction], state: TrainingState) -> list[str]:
    """The parameters ZeRO stage `state` may shard."""
    pick = {TrainingState.ZERO3: zero3_candidates, TrainingState.ZERO2: zero2_candidates}
    return pick.get(state, zero_candidates)(pb, program)


def with_states(program: Sequence[Instruction], tensors: Sequence[str],
                state: TrainingState = TrainingState.ZERO1) -> tuple[Instruction, ...]:
    """The program with these parameters' training state set to `state`."""
    chosen = set(tensors)
    return tuple(i.model_copy(update={"state": state}) if i.kind == "param" and i.tensor in chosen else i
                 for i in program)


def zero_tensors(program: Sequence[Instruction], states=SHARDED_STATES) -> list[str]:
    """The parameters whose state is sharded in rows (of `states`: ZeRO-1 and ZeRO-2)."""
    return [i.tensor for i in program if i.kind == "param" and i.state in states]


def zero_stages(program: Sequence[Instruction]) -> dict[int, int]:
    """ZeRO stage -> how many parameters use it."""
    stages = {TrainingState.ZERO1: 1, TrainingState.ZERO2: 2, TrainingState.ZERO3: 3}
    out: dict[int, int] = {}
    for i in program:
        if i.kind == "param" and i.state in stages:
            out[stages[i.state]] = out.get(stages[i.state], 0) + 1
    return dict(sorted(out.items()))


def state_shards(pb: Problem, program: Sequence[Instruction]) -> StateShards | None:
    """Every ZeRO parameter's rows per rank at pb's state ratios (None: none is ZeRO)."""
    tensors = zero_tensors(program)
    if not tensors:
        return None
    assert pb.state_ratios is not None
    return StateShards(ratios=pb.state_ratios, variant=state_gather_variant(pb, program),
                       scatter_variant=state_scatter_variant(pb, program),
                       rows={t: state_rows(pb.state_ratios, pb.meta(t).shape[0]) for t in tensors})


def _fixed_parts(pb: Problem, program: Sequence[Instruction]) -> tuple[list[float], float, list[float]]:
    """Per class: bytes of everything but the sharded state (M_c); the state bytes S; update
    seconds of all ZeRO parameters on the whole rows (U_c)."""
    whole = {TrainingState.ZERO1: 2, TrainingState.ZERO2: 1, TrainingState.ZERO3: 0}  # copies not on rows
    states = {i.tensor: i.state for i in program if i.kind == "param" and i.state in SHARDED_STATES}
    probe = Problem(pb.graph, pb.cluster, pb.ratios, pb.restrictions,
                    state_ratios=(0.0,) * pb.cluster.num_devices)
    fixed = memory_bytes(pb.width, program_terms(probe, program))
    state = float(sum((OPTIMIZER_COPIES - whole[z]) * pb.meta(t).nbytes for t, z in states.items()))
    zero = set(states)
    update = [0.0] * pb.width
    for t in zero:
        cost = pb.update_rows_linear(t)
        update = [u + a + b for u, a, b in zip(update, cost.a, cost.b)]
    return fixed, state, update


STATE_OBJECTIVES = ("time", "memory")  # the state LP's two orders (module docstring)


def solve_state_ratios(pb: Problem, program: Sequence[Instruction], objective: str = "time"
                       ) -> tuple[tuple[float, ...], bool]:
    """q per device (module docstring's LP, `objective` first: "time", or "memory" for the rows
    that leave every device the same fraction of its memory free), and whether the state fits
    at it: where no q fits, the q that leaves the largest share of memory over (mu > 1) least
    exceeded."""
    if objective not in STATE_OBJECTIVES:
        raise ValueError(f"state LP objective {objective!r}: expected one of {STATE_OBJECTIVES}")
    fixed, state, update = _fixed_parts(pb, program)
    caps, counts, gather = [k.memory_gib * 2**30 for k in pb.kinds], pb.devices.counts, _comm_seconds(pb, program)
    first = _time_first if objective == "time" else _memory_first
    per_class, fits = first(counts, update, gather, fixed, state, caps)
    total = sum(n * x for n, x in zip(counts, per_class))
    return pb.devices.expand([x / total for x in per_class]), fits


def _time_first(counts, update, gather, fixed, state, caps) -> tuple[list[float], bool]:
    """The fastest q within memory; then, within 0.1% of that time, the most balanced."""
    prob, q, t, m = _state_lp(counts, update)
    for c, cap in enumerate(caps):
        prob += fixed[c] + state * q[c] <= cap, f"memory_{c}"
    prob += t + gather * m
    best_s = _solve(prob)
    prob, q, t, m = _state_lp(counts, update)  # the balance: a fresh LP, bounded by that time
    if best_s is not None:
        prob += t + gather * m <= best_s * (1 + 1e-3) + 1e-12, "time"
    mu = prob.add_variable("mu", lowBound=0)
    for c, cap in enumerate(caps):
        prob += fixed[c] + state * q[c] <= mu * cap, f"balance_{c}"
    prob += mu + 1e-3 * m  # among the most balanced, the evenest rows (the padded gather's)
    if _solve(prob) is None:
        raise MemoryInfeasible("state-ratio LP has no solution")
    return [max(0.0, float(v.value() or 0.0)) for v in q], best_s is not None


def _memory_first(counts, update, gather, fixed, state, caps) -> tuple[list[float], bool]:
    """The most balanced q (least mu); then, within 0.1% of that mu, the fastest."""
    prob, q, t, m = _state_lp(counts, update)
    mu = prob.add_variable("mu", lowBound=0)
    for c, cap in enumerate(caps):
        prob += fixed[c] + state * q[c] <= mu * cap, f"balance_{c}"
    prob += mu
    best_mu = _solve(prob)
    if best_mu is None:
        raise MemoryInfeasible("state-ratio LP has no solution")
    prob, q, t, m = _state_lp(counts, update)
    for c, cap in enumerate(caps):
        prob += fixed[c] + state * q[c] <= best_mu * (1 + 1e-3) * cap, f"balance_{c}"
    prob += t + gather * m
    if _solve(prob) is None:
        raise MemoryInfeasible("state-ratio LP has no solution")
    return [max(0.0, float(v.value() or 0.0)) for v in q], best_mu <= 1.0


def _comm_seconds(pb: Problem, program: Sequence[Instruction]) -> float:
    """G of the module docstring: the ZeRO collectives' padded seconds per unit of the largest share."""
    uses = zero3_uses(pb, program)

    def nbytes(states: set, per_use: bool = False) -> float:
        return float(sum(pb.meta(t).nbytes * (uses.get(t, 0) if per_use else 1)
                         for t in zero_tensors(program, states)))
    z3 = {TrainingState.ZERO3}
    return _padded_seconds(pb, "all_gather", nbytes({TrainingState.ZERO1, TrainingState.ZERO2}) + 2 * nbytes(z3, True)) \
        + _padded_seconds(pb, "reduce_scatter", nbytes({TrainingState.ZERO2}) + nbytes(z3, True))


def _padded_seconds(pb: Problem, kind: str, nbytes: float) -> float:
    """G: a padded collective's seconds at even q, per unit of the largest share."""
    g = pb.cluster.num_devices
    if g == 1 or nbytes == 0.0:
        return 0.0
    return pb.comm.cost(kind, "padded", nbytes, "all").at((1.0 / g,) * pb.width) * g


def _state_lp(counts: Sequence[int], update: Sequence[float]) -> tuple:
    prob = pulp.LpProblem("state_ratios", pulp.LpMinimize)
    q = [prob.add_variable(f"q_{c}", lowBound=0, upBound=1) for c in range(len(counts))]
    t, m = prob.add_variable("t", lowBound=0), prob.add_variable("m", lowBound=0)
    prob += pulp.lpSum(n * x for n, x in zip(counts, q)) == 1, "simplex"
    for c, u in enumerate(update):
        prob += t >= u * q[c], f"update_{c}"
        prob += m >= q[c], f"largest_{c}"
    return prob, q, t, m


def _solve(prob: pulp.LpProblem) -> float | None:
    """The optimum, or None when the LP is infeasible."""
    prob.solve(_solver()[0])
    if pulp.LpStatus[prob.status] != "Optimal":
        return None
    return float(pulp.value(prob.objective))


def zero_problem(pb: Problem, program: Sequence[Instruction], state: TrainingState = TrainingState.ZERO1,
                 objective: str = "time") -> tuple[Problem, tuple[Instruction, ...]] | None:
    """The program with every candidate at ZeRO stage `state` and the problem at its LP's
    state ratios (`objective` first), or None when there is no candidate."""
    found = zero_problems(pb, program, state, (objective,))
    return found[0] if found else None


def zero_problems(pb: Problem, program: Sequence[Instruction], state: TrainingState = TrainingState.ZERO1,
                  objectives: Sequence[str] = STATE_OBJECTIVES) -> list[tuple[Problem, tuple[Instruction, ...]]]:
    """zero_problem at each objective's state ratios, the same ratios once (empty without a
    candidate)."""
    tensors = stage_candidates(pb, program, state)
    if not tensors:
        return []
    zero, out = with_states(program, tensors, state), []
    for objective in objectives:
        q, fits = solve_state_ratios(pb, zero, objective)
        log.info("%s of %d parameters at state ratios %s (%s first; %s)", state, len(tensors), _runs(q), objective,
                 "the state fits" if fits else "the state alone does not fit: the ratios least over")
        if all(any(abs(a - b) > 1e-6 for a, b in zip(q, p.state_ratios)) for p, _ in out):
            out.append((with_state_ratios(pb, q), zero))
    return out


def _runs(values: Sequence[float]) -> str:
    """Ratios as text, a run of equal ones once with its count ("0.001 x768, 0.002 x256"):
    a 1,024-device cluster's line stays readable."""
    out: list[list] = []
    for text in (f"{x:.3f}" for x in values):
        if out and out[-1][0] == text:
            out[-1][1] += 1
        else:
            out.append([text, 1])
    return ", ".join(t if n == 1 else f"{t} x{n}" for t, n in out)


def with_state_ratios(pb: Problem, state_ratios: Sequence[float]) -> Problem:
    return Problem(pb.graph, pb.cluster, pb.ratios, pb.restrictions, state_ratios=state_ratios)


__all__ = ["STATE_OBJECTIVES", "solve_state_ratios", "zero_problems", "state_shards", "with_state_ratios", "with_states", "zero_problem",
           "zero3_candidates", "zero_candidates", "zero_stages", "zero_tensors"]
