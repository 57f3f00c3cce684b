"""Plan synthesis: alternate the A* search and the sharding-ratio LP (HAP, section 5).

    ratios <- throughput-proportional
    repeat (at most `max_rounds`):
        program <- A* at ratios                         (planner.synthesis)
        ratios' <- LP for program                       (planner.ratios)
        evaluate program at ratios' rounded to shard lengths
        stop when the predicted step time improves by less than 0.1%
        ratios <- ratios'

Each search is seeded with the data-parallel and the Megatron-style programs at the same
ratios (the same search restricted to those spaces, planner.baselines): the cheaper is the
incumbent, a point of the search space that prunes by branch and bound and is returned when
the bounded search finds nothing cheaper. The search's cost charges each gradient all-reduce
unoverlapped, so the search's program and the seeds' are then all predicted in full (the
backward overlapped with the gradient buckets at each one's best cap, planner.step_cost) and
the fastest goes on to the LP: data parallelism at throughput-proportional rows with a flat
ring, torch DDP-CP's own shape, is always a candidate. The best (program, ratios) pair evaluated wins. When the LP finds no ratios that fit the
program in memory, the fewest of its blocks are recomputed that make it fit (planner.recompute);
when even recomputing all does not, the search is repeated with a memory penalty (seconds per byte, escalated
x4 per attempt) on replicated parameters and activations, which steers it to sharded
storage; if no attempt fits, `PlanInfeasible` names the device that is short of memory, by
how many GiB, for the best plan found. A problem whose training state alone exceeds the
cluster's memory is refused before any search (planner.feasibility). Under a precision policy
(make_plan's `precision`) all of this runs on the graph and cluster as the policy costs them
(cost_models.precision: each kind at its compute dtype's matmul rate, activations at their width).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from hetsynth.cost_models.memory import GIB
from hetsynth.cost_models.precision import costed
from hetsynth.cost_models.terms import seconds
from hetsynth.instruction_set.cluster import ClusterSpec
from hetsynth.instruction_set.graph import ReferenceGraph
from hetsynth.instruction_set.layouts import P, R, Layout
from hetsynth.instruction_set.mixed_precision import Precision, choose_policy
from hetsynth.instruction_set.plan import ModelInfo, Plan, Prediction, SynthesisStats
from hetsynth.instruction_set.plan_checks import ShardTable
from hetsynth.instruction_set.program import COLLECTIVES, Instruction
from hetsynth.instruction_set.sync import BucketShape, GradientSync
from hetsynth.instruction_set.training_state import TrainingState
from hetsynth.planner import baselines
from hetsynth.planner.evaluate import first_input_layouts, instruction_term, predict
from hetsynth.planner.feasibility import PlanInfeasible, check_memory_lower_bound, gib
from hetsynth.planner.problem import Problem, Restrictions, plan_problem, plan_views
from hetsynth.planner.ratios import MemoryInfeasible, least_memory_overflow, solve_ratios
from hetsynth.instruction_set.blocks import mark_recomputed, recompute_units, recomputed_units
from hetsynth.planner.recompute import fit_by_recompute
from hetsynth.planner.fusions import fuse_program, unfuse_program
from hetsynth.planner.step_cost import choose_buckets, predict_program, program_terms
from hetsynth.planner.synthesis import DEFAULT_WIDTH, SearchResult, synthesize
from hetsynth.planner.zero import (STATE_OBJECTIVES, solve_state_ratios, state_shards, stage_candidates, with_states,
                          zero_problem, zero_problems, zero_stages)

log = logging.getLogger(__name__)

MEMORY_ATTEMPTS = 6
SEED_WIDTH = 8  # the incumbents' spaces are narrow; a small width finds their optimum

# The incumbent of every search: data parallelism (any all-reduce variant, SFB allowed).
DP_SEED = dataclasses.replace(baselines.DP, allow_sfb=True)


@dataclass(frozen=True)
class Candidate:
    ratios: tuple[float, ...]
    program: tuple[Instruction, ...]
    prediction: Prediction
    sync: GradientSync = field(compare=False)  # the gradient buckets the prediction assumes
    problem: Problem = field(compare=False)    # at these ratios, unpenalised

    def better_than(self, other: "Candidate | None") -> bool:
        if other is None:
            return True
        if self.prediction.fits != other.prediction.fits:
            return self.prediction.fits
        if not self.prediction.fits:
            return _overflow(self) < _overflow(other)
        return self.prediction.step_time_s < other.prediction.step_time_s


def _overflow(c: Candidate) -> float:
    return max(d.memory_gib - d.memory_capacity_gib for d in c.prediction.devices)


@dataclass
class _Stats:
    search_s: float = 0.0
    lp_s: float = 0.0
    expanded: int = 0
    rounds: int = 0
    exact: bool = True


def _evaluate(graph: ReferenceGraph, cluster: ClusterSpec, ratios: Sequence[float],
              program: Sequence[Instruction], restrictions: Restrictions | None = None,
              state_ratios: Sequence[float] | None = None) -> Candidate:
    pb = Problem(graph, cluster, ratios, restrictions, state_ratios=state_ratios)
    prediction, sync = predict_program(pb, program)
    return Candidate(tuple(ratios), tuple(program), prediction, sync, pb)


def _alternate(graph: ReferenceGraph, cluster: ClusterSpec, ratios: tuple[float, ...],
               fixed: bool, width: int, progress: bool, memory_weight: float, stats: _Stats,
               max_rounds: int, restrictions: Restrictions | None, allow_zero: bool = True) -> Candidate:
    best: Candidate | None = None
    for _ in range(max_rounds):
        stats.rounds += 1
        programs = _programs(graph, cluster, ratios, memory_weight, width, progress, stats, restrictions)
        pb = Problem(graph, cluster, ratios, restrictions)
        current, terms = _best_predicted(
            pb, programs, lambda c: _fit_memory(graph, cluster, c, fixed, restrictions, stats, allow_zero))
        best = current if current.better_than(best) else best
        if fixed:
            break
        try:
            solution = solve_ratios(terms, [k.memory_gib for k in pb.kinds], classes=pb.devices)
        except MemoryInfeasible:
            log.info("round %d: no ratios fit this program in memory", stats.rounds)
            break
        stats.lp_s += solution.seconds
        moved = _evaluate(graph, cluster, pb.devices.expand(solution.ratios), current.program, restrictions,
                          current.problem.state_ratios)
        log.info("round %d: program %.2f ms at the ratios searched, %.2f ms at the LP's ratios (%d device "
                 "classes, %.1f s so far)", stats.rounds, current.prediction.step_time_s * 1e3,
                 moved.prediction.step_time_s * 1e3, pb.width, stats.search_s + stats.lp_s)
        improved = moved.prediction.step_time_s < best.prediction.step_time_s * (1 - 1e-3)
        best = moved if moved.better_than(best) else best
        if not improved:
            break
        ratios = moved.ratios
    assert best is not None
    return best


def _seeds(graph: ReferenceGraph, cluster: ClusterSpec, ratios: tuple[float, ...],
           memory_weight: float, width: int, stats: _Stats) -> list[SearchResult]:
    """The incumbents: data parallelism and Megatron-style programs at these ratios."""
    out = []
    for restrictions in (DP_SEED, baselines.megatron_restrictions(cluster)):
        result = synthesize(Problem(graph, cluster, ratios, restrictions, memory_weight),
                            width=min(width, SEED_WIDTH), progress=False)
        if result is not None:
            _count(stats, result)
            out.append(result)
    return out


def _count(stats: _Stats, result: SearchResult) -> None:
    stats.search_s += result.seconds
    stats.expanded += result.states_expanded
    stats.exact &= result.exact


def _best_predicted(pb: Problem, programs: Sequence[Sequence[Instruction]],
                    fit: Callable[[Candidate], Candidate | None] | None = None) -> tuple[Candidate, list]:
    """The program with the fastest step as predicted with its gradient sync overlapped and at
    its best bucket cap (what _evaluate predicts, and what the LP then sees), with its terms.
    The search's own cost charges each gradient all-reduce unoverlapped, so a seed it beat
    (data parallelism: torch DDP's shape) may still be the faster step. A program that does
    not fit but is faster than every one that does is made to fit by `fit` (ZeRO-1,
    recomputation: _fit_memory) when some program fits as it is; where none does, the planner
    fits the best one afterwards (search_plan), and where every program fits nothing changes."""
    scored = []
    for program in programs:
        sync, terms = choose_buckets(pb, program)
        scored.append((Candidate(pb.ratios, tuple(program), predict(pb, terms), sync, pb), terms))
    fitting = [c.prediction.step_time_s for c, _ in scored if c.prediction.fits]
    if fit is not None and fitting:
        scored = [_fitted(c, t, fit) if not c.prediction.fits and c.prediction.step_time_s < min(fitting)
                  else (c, t) for c, t in scored]
    best = scored[0]
    for candidate, terms in scored[1:]:
        best = (candidate, terms) if candidate.better_than(best[0]) else best
    return best


def _fitted(candidate: Candidate, terms: list, fit: Callable[[Candidate], Candidate | None]) -> tuple[Candidate, list]:
    """`candidate` made to fit in memory with its terms, or itself when nothing fits."""
    found = fit(candidate)
    if found is None:
        return candidate, terms
    log.info("a program of %.2f ms that does not fit fits in %.2f ms (%s)", candidate.prediction.step_time_s * 1e3,
             found.prediction.step_time_s * 1e3, techniques(found.program))
    return found, choose_buckets(found.problem, found.program)[1]


def _programs(graph: ReferenceGraph, cluster: ClusterSpec, ratios: tuple[float, ...],
              memory_weight: float, width: int, progress: bool, stats: _Stats,
              restrictions: Restrictions | None) -> list[tuple[Instruction, ...]]:
    """A* with the seeds' (data parallelism, Megatron) best cost as incumbent: the search's
    program if it found a cheaper one, and the seeds' programs, all at these ratios. A
    restricted search (baselines, forced layouts for tests) has no seeds."""
    pb = Problem(graph, cluster, ratios, restrictions, memory_weight=memory_weight)
    if progress:
        log.info("round %d: searching %d ops on %d devices in %d classes of interchangeable devices",
                 stats.rounds, len(pb.order), cluster.num_devices, pb.width)
    if restrictions is not None:
        found = synthesize(pb, width=width, progress=progress)
        _count(stats, found)
        return [found.instructions]
    seeds = _seeds(graph, cluster, ratios, memory_weight, width, stats)
    found = synthesize(pb, width=width, progress=progress, incumbent=min(r.cost_s for r in seeds))
    if found is not None:
        _count(stats, found)
    return ([found.instructions] if found is not None else []) + [r.instructions for r in seeds]


def search_plan(graph: ReferenceGraph, cluster: ClusterSpec, *, ratios: Sequence[float] | None = None,
                width: int = DEFAULT_WIDTH, progress: bool = True, max_rounds: int = 6,
                restrictions: Restrictions | None = None, allow_zero: bool = True,
                keep_unfit: bool = False) -> tuple[Candidate, _Stats]:
    """The best program and ratios (raises PlanInfeasible when nothing fits in memory);
    `allow_zero`: the planner may shard optimizer state (ZeRO-1) to fit. `keep_unfit`: when
    no program fits, the one closest to fitting (its prediction's `fits` False, the shortfall
    logged) instead of the error; the lower bound (planner.feasibility) still raises, since
    then nothing fits, a pipeline's stages included."""
    check_memory_lower_bound(graph, cluster)
    fixed = ratios is not None
    start = tuple(_normalise(ratios, cluster) if fixed else baselines.proportional(cluster))
    log.info("planning %s (%d ops) for %s (%d devices)", graph.model_ref, len(graph.calls), cluster.name,
             cluster.num_devices)
    stats, weight, best = _Stats(), 0.0, None
    for attempt in range(MEMORY_ATTEMPTS):
        candidate = _alternate(graph, cluster, start, fixed, width, progress, weight, stats, max_rounds,
                               restrictions, allow_zero)
        best = candidate if candidate.better_than(best) else best
        if best.prediction.fits:
            return best, stats
        fitted = _fit_memory(graph, cluster, candidate, fixed, restrictions, stats, allow_zero)
        if fitted is not None:
            return fitted, stats
        weight = _next_weight(weight, candidate)
        if attempt + 1 < MEMORY_ATTEMPTS:
            log.info("the best plan needs %.2f GiB more than a device holds; searching again with a "
                     "memory penalty (attempt %d of %d)", _overflow(best), attempt + 2, MEMORY_ATTEMPTS)
    if keep_unfit:
        log.warning("%s", _shortfall_message(graph, cluster, best, allow_zero))
        return best, stats
    raise PlanInfeasible(_shortfall_message(graph, cluster, best, allow_zero))


def _fit_memory(graph: ReferenceGraph, cluster: ClusterSpec, candidate: Candidate, fixed: bool,
                restrictions: Restrictions | None, stats: _Stats, allow_zero: bool = True) -> Candidate | None:
    """`candidate` made to fit in memory, the fastest of: its replicated parameters' training
    state sharded in rows (ZeRO-1: the optimizer state; ZeRO-2: the gradient too; ZeRO-3: the
    parameter too; planner.zero), each with the fewest blocks recomputed that then fit if
    needed; and the fewest blocks recomputed without ZeRO. None when none fits.

    The rows follow the memories: the ZeRO stages are tried at the state LP's memory-first
    ratios (every device left the same fraction of its memory free, so a device with more
    free memory holds more rows; planner.zero), the collectives costed at those rows (the
    padded ones at the largest share). Only when nothing fits so are the time-first ratios
    tried (rows where the collectives and updates are fastest, memory a constraint)."""
    allowed = allow_zero and candidate.problem.restrictions.allow_zero
    options = [_recomputed(graph, cluster, candidate, fixed, restrictions, stats)]
    for objective in STATE_OBJECTIVES[::-1] if allowed else ():
        staged = [z for s in ZERO_STATES for z in zero_problems(candidate.problem, candidate.program, s, (objective,))]
        options += _zero_options(graph, cluster, candidate, fixed, restrictions, stats, staged, options)
        if any(c is not None for c in options):
            break
    found = [c for c in options if c is not None]
    if not found:
        return None
    best = min(found, key=lambda c: c.prediction.step_time_s)
    log.info("fits in memory with %s", techniques(best.program))
    return best


def _zero_options(graph: ReferenceGraph, cluster: ClusterSpec, candidate: Candidate, fixed: bool,
                  restrictions: Restrictions | None, stats: _Stats, staged: list, options: list) -> list:
    """The ZeRO programs `staged` (problem, program) that fit, each with the fewest blocks
    recomputed that fit if needed. A stage that does not fit as it is gets the recomputation
    search only when its step without recomputation (recomputation only adds time) beats the
    best of `options` and of those found so far, and none other is as fast and needs no more
    memory on any device (it would need no more blocks recomputed); the stages that fit as
    they are come first."""
    found, short = [], []
    for pb, program in staged:
        plain = predict(pb, program_terms(pb, program))  # memory does not depend on the buckets
        if plain.fits:
            found.append(_evaluate(graph, cluster, pb.ratios, program, restrictions, pb.state_ratios))
        else:
            short.append((plain, pb, program))
    for step_s, pb, program in sorted(_undominated(short), key=lambda x: x[0]):
        best_s = min((c.prediction.step_time_s for c in options + found if c is not None), default=math.inf)
        if step_s >= best_s:
            log.info("%s: %.2f ms before recomputation, not faster than %.2f ms", techniques(program),
                     step_s * 1e3, best_s * 1e3)
            continue
        sharded = dataclasses.replace(candidate, program=program, problem=pb)
        found.append(_recomputed(graph, cluster, sharded, fixed, restrictions, stats))
    return found


def _undominated(short: list[tuple[Prediction, Problem, tuple[Instruction, ...]]]) -> list[tuple[float, Problem, tuple]]:
    """(step seconds, problem, program) of the predictions no other is as fast as while needing
    no more memory on every device (ties: the first kept)."""
    def covers(a: Prediction, b: Prediction) -> bool:
        return a.step_time_s <= b.step_time_s and all(x.memory_gib <= y.memory_gib for x, y in zip(a.devices, b.devices))
    kept = [x for k, x in enumerate(short)
            if not any(covers(o[0], x[0]) and (not covers(x[0], o[0]) or j < k) for j, o in enumerate(short) if j != k)]
    return [(p.step_time_s, pb, program) for p, pb, program in kept]


ZERO_STATES = (TrainingState.ZERO1, TrainingState.ZERO2, TrainingState.ZERO3)  # tried where memory binds


def techniques(program: Sequence[Instruction]) -> str:
    """What a program uses to fit in memory, in words."""
    units = recomputed_units(program)
    used = [f"ZeRO-{stage} for {n} parameters" for stage, n in zero_stages(program).items()]
    used += [f"recomputation of {len(units)} blocks"] if units else []
    return " and ".join(used) or "no ZeRO and no recomputation (none applies)"


def _recomputed(graph: ReferenceGraph, cluster: ClusterSpec, candidate: Candidate, fixed: bool,
                restrictions: Restrictions | None, stats: _Stats) -> Candidate | None:
    """`candidate`'s program with the fewest blocks recomputed that fits, at the ratio LP's
    ratios (planner.recompute), or None."""
    fitting: dict[int, Candidate] = {}  # by id of the program (instructions are not hashable)

    q = candidate.problem.state_ratios

    def fits(program: tuple[Instruction, ...]) -> bool:  # at the default buckets: buckets hold no memory
        pb = Problem(graph, cluster, candidate.ratios, restrictions, state_ratios=q)
        ratios = candidate.ratios
        if not fixed:
            try:
                solution = solve_ratios(program_terms(pb, program), [k.memory_gib for k in pb.kinds],
                                        classes=pb.devices)
            except MemoryInfeasible:
                return False
            stats.lp_s += solution.seconds
            ratios = pb.devices.expand(solution.ratios)
        found = _evaluate(graph, cluster, ratios, program, restrictions, q)  # buckets chosen: the plan records them
        if found.prediction.fits:
            fitting[id(program)] = found
        return found.prediction.fits

    program = fit_by_recompute(candidate.problem, candidate.program, fits)
    return None if program is None else fitting[id(program)]


def _next_weight(weight: float, candidate: Candidate) -> float:
    """Seconds per byte: first so that the largest memory costs about one step time."""
    if weight == 0.0:
        peak = max(d.memory_gib for d in candidate.prediction.devices) * GIB
        return candidate.prediction.step_time_s / max(peak, 1.0)
    return weight * 4.0


def _shortfall_message(graph: ReferenceGraph, cluster: ClusterSpec, best: Candidate, allow_zero: bool = True) -> str:
    """Where the best plan found is short of memory with every technique applied: its
    replicated parameters' state sharded (the last of ZERO_STATES, at the state LP's ratios), all its
    blocks recomputed, and the ratios that minimise the largest overflow."""
    pb, program = _most_memory_saving(best, allow_zero)
    ratios, over = least_memory_overflow(program_terms(pb, program), [k.memory_gib for k in pb.kinds],
                                         classes=pb.devices)
    worst = max(range(len(over)), key=lambda i: over[i])
    device = cluster.devices[pb.devices.reps[worst]]
    cap = pb.kinds[worst].memory_gib
    others = pb.devices.counts[worst] - 1
    return (f"no plan fits in memory: the best plan found needs {gib(cap + over[worst])} GiB on device "
            f"{device.name!r} ({device.kind}, {cap:g} GiB{f'; and {others} more like it' if others else ''}), "
            f"short by {gib(over[worst])} GiB even with memory-optimal ratios and {techniques(program)}; use "
            f"devices with more memory, a smaller batch or a smaller model")


def shortfall_message(plan: Plan) -> str:
    """PlanInfeasible's message for a plan that does not fit (`make_plan(keep_unfit=True)`)."""
    pb = plan_problem(plan)
    program = tuple(unfuse_program(pb, plan.instructions))
    prediction, sync = predict_program(pb, program, None)
    return _shortfall_message(pb.graph, pb.cluster, Candidate(plan.sharding_ratios, program, prediction, sync, pb))


def _most_memory_saving(best: Candidate, allow_zero: bool = True) -> tuple[Problem, tuple[Instruction, ...]]:
    """The best candidate's program with its most memory-saving ZeRO stage (where allowed) and
    every block recomputed."""
    pb, program = best.problem, best.program
    allowed = allow_zero and pb.restrictions.allow_zero
    zero = next((z for z in (zero_problem(pb, program, s, "memory") for s in reversed(ZERO_STATES if allowed else ()))
                 if z is not None), None)
    if zero is not None:
        pb, program = zero
    return pb, mark_recomputed(program, recompute_units(pb.graph, program))


def _normalise(ratios: Sequence[float], cluster: ClusterSpec) -> tuple[float, ...]:
    if len(ratios) != cluster.num_devices:
        raise ValueError(f"{len(ratios)} ratios given for {cluster.num_devices} devices "
                         f"({', '.join(d.name for d in cluster.devices)})")
    if not all(math.isfinite(r) and r >= 0 for r in ratios) or sum(ratios) <= 0:
        raise ValueError(f"ratios must be finite, >= 0 and have a positive sum, got {list(ratios)}")
    if not math.isfinite(sum(ratios)):  # finite ratios (1e308, 1e308) whose sum overflows: scale them first
        ratios = [r / max(ratios) for r in ratios]
    return tuple(r / sum(ratios) for r in ratios)


def finalize(pb: Problem, program: Sequence[Instruction]) -> tuple[Instruction, ...]:
    """Instructions with predicted seconds (and variant alternatives) at the final ratios."""
    x_layouts = first_input_layouts(program)
    out = []
    for ins in program:
        term = instruction_term(pb, ins, x_layouts)
        update: dict = {"predicted_s": seconds(term.time) if term else 0.0}
        if ins.kind in COLLECTIVES and ins.phase == "forward":
            step = pb.collective(ins.tensor, ins.kind, ins.src, ins.layout, ins.axis)
            update["alternatives"] = dict(step.alternatives)
        out.append(ins.model_copy(update=update))
    return tuple(out)


def shard_table(pb: Problem, program: Sequence[Instruction]) -> ShardTable:
    """Per-rank local lengths of every split dim of every layout the program uses."""
    table: ShardTable = {}

    def add(tensor: str, layout: Layout) -> None:
        if layout.is_shard:
            table.setdefault(tensor, {})[layout] = pb.lengths.rank_lengths(tensor, layout)

    for ins in program:
        add(ins.tensor, ins.layout)
        if ins.src is not None:
            add(ins.src_tensor(pb.graph.node(ins.node).inputs if ins.node else ()), ins.src)
        if ins.runs_op:
            for t, layout in zip(pb.graph.node(ins.node).inputs, ins.inputs):
                add(t, layout)
    return table


def model_info(graph: ReferenceGraph) -> ModelInfo:
    inputs = [n for n in graph.nodes if n.op == "input"]
    floats = [n.out.dtype for n in graph.params if n.out.is_float]
    return ModelInfo(ref=graph.model_ref, fingerprint=graph.fingerprint, num_params=graph.num_params,
                     batch_size=inputs[0].out.shape[0] if inputs and inputs[0].out.shape else 1,
                     dtype=floats[0] if floats else "float32")


def make_plan(graph: ReferenceGraph, cluster: ClusterSpec, *, ratios: Sequence[float] | None = None,
              width: int = DEFAULT_WIDTH, progress: bool = True,
              restrictions: Restrictions | None = None, with_baselines: bool = True,
              bucket_cap: int | None = None, allow_zero: bool = True, keep_unfit: bool = False,
              precision: Precision | str = Precision.FP32, reduce_dtype: str = "float32") -> Plan:
    """Synthesize the plan for `graph` on `cluster`, with its baselines. `restrictions`
    narrows the program space (forced layouts or variants, used by tests); `bucket_cap`
    forces the gradient bucket cap in bytes (default: the one the cost model predicts fastest);
    `keep_unfit` as in `search_plan` (the plan's `predicted.fits` then says so). `precision`
    chooses each device kind's compute dtype (instruction_set.mixed_precision; PrecisionError
    where a kind lacks the one asked for); search, LP and baselines cost the graph and cluster
    as that policy makes them (cost_models.precision), and the plan records the policy;
    `reduce_dtype` the dtype gradients are reduced in (float32, or bfloat16 at half the traffic)."""
    start = time.perf_counter()
    policy = choose_policy(cluster, precision, reduce_dtype)
    costed_graph, costed_cluster = costed(graph, cluster, policy)
    if policy.is_mixed and progress:  # not once per pipeline stage program
        log.info("precision %s", policy.describe())
    best, stats = search_plan(costed_graph, costed_cluster, ratios=ratios, width=width, progress=progress,
                              restrictions=restrictions, allow_zero=allow_zero, keep_unfit=keep_unfit)
    seconds = time.perf_counter() - start
    if with_baselines:
        log.info("plan found in %.1f s (%.2f ms/step); costing the baselines", seconds,
                 best.prediction.step_time_s * 1e3)
    pb = best.problem
    program = list(best.program)
    if pb.restrictions.allow_fusion:
        program = fuse_program(pb, program, force=pb.restrictions.force_fusion)
    if bucket_cap is None and len(program) == len(best.program):
        prediction, sync = best.prediction, best.sync
    else:
        prediction, sync = predict_program(pb, program, BucketShape(bucket_cap) if bucket_cap else None)
    return Plan(
        model=model_info(graph), cluster=cluster, mesh=pb.mesh,
        graph=graph, sharding_ratios=best.ratios,
        shards=shard_table(pb, program), instructions=finalize(pb, program),
        predicted=prediction, gradient_sync=sync, state_shards=state_shards(pb, program),
        baselines=baselines.all_baselines(costed_graph, costed_cluster, width=width) if with_baselines else {},
        synthesis=SynthesisStats(seconds=seconds, search_seconds=stats.search_s,
                                 lp_seconds=stats.lp_s, states_expanded=stats.expanded,
                                 rounds=stats.rounds, heuristic="compute suffix + pending conversions",
                                 exact=stats.exact),
        precision=policy,
    )


def without_fusion(plan: Plan) -> Plan:
    """The same plan with every fused collective-matmul as its plain pair (same layouts,
    ratios and shard lengths), re-predicted: the control of bench/overlap.py."""
    pb = plan_problem(plan)
    program = unfuse_program(pb, plan.instructions)
    prediction, sync = predict_program(pb, program, plan.gradient_sync.shape if plan.gradient_sync else None)
    return plan.model_copy(update={"instructions": finalize(pb, program), "predicted": prediction,
                                   "gradient_sync": sync})


def without_sfb(plan: Plan) -> Plan:
    """The same plan with every SFB weight synchronised by a backward all-reduce instead
    (same layouts, ratios and shard lengths), re-predicted: the control of the SFB benchmark."""
    pb = plan_problem(plan)
    program = []
    for ins in plan.instructions:
        if ins.kind == "sfb":
            nbytes = pb.meta(ins.tensor).nbytes
            ins = Instruction(kind="all_reduce", tensor=ins.tensor, layout=R, src=P, phase="backward",
                              variant=pb.comm.gradient_variant(nbytes))
        program.append(ins)
    prediction, sync = predict_program(pb, program)
    return plan.model_copy(update={"instructions": finalize(pb, program), "predicted": prediction,
                                   "gradient_sync": sync})


def with_zero(plan: Plan, state_ratios: Sequence[float] | None = None,
              state: TrainingState = TrainingState.ZERO1, scatter_variant: str | None = None) -> Plan:
    """The same plan with every replicated trained parameter's training state sharded in rows
    (ZeRO stage `state`) at `state_ratios` (default: the state LP's memory-first rows, as the
    planner tries first, planner.zero), re-predicted
    (`scatter_variant`: the ZeRO-2 gradients' reduce-scatter variant; default the fastest)."""
    variants = {"reduce_scatter": (scatter_variant,)} if scatter_variant else {}
    restrictions = Restrictions(two_level=plan.mesh.two_level, variants=variants)
    graph, cluster = plan_views(plan)
    pb = Problem(graph, cluster, plan.sharding_ratios, restrictions)
    program = with_states(plan.instructions, stage_candidates(pb, plan.instructions, state), state)
    q = tuple(_normalise(state_ratios, plan.cluster)) if state_ratios is not None else \
        solve_state_ratios(pb, program, "memory")[0]
    pb = Problem(graph, cluster, plan.sharding_ratios, restrictions, state_ratios=q)
    prediction, sync = predict_program(pb, program)
    return plan.model_copy(update={"instructions": finalize(pb, program), "predicted": prediction,
                                   "gradient_sync": sync, "state_shards": state_shards(pb, program)})


def with_zero1(plan: Plan, state_ratios: Sequence[float] | None = None) -> Plan:
    return with_zero(plan, state_ratios, TrainingState.ZERO1)
