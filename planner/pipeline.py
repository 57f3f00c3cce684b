"""Pipeline plans for a given stage choice: stage programs, boundaries, micro-batches, schedule.

`make_pipeline_plan(spmd, spec, cluster, stages=[(ranks, (start, stop)), ...], ...)` turns a
stage choice (contiguous calls on contiguous ranks; `auto_stages` chooses one by
planner.stage_dp) into the plan's `pipeline`:
1. the micro-batch sizes and graphs (planner.microbatch; a coupled graph gets one micro-batch);
2. per stage, its graph (instruction_set.stages) at the largest micro-batch size (the smallest
   when that program cannot run at the smallest: `_stage_plans`), synthesized on the stage's
   sub-cluster by the existing search and ratio LP (or at given ratios); the same program at
   the other size, its activations' shard lengths derived there (`program_at`);
3. per boundary tensor and destination layout, the cross-mesh resharding plan
   (planner.resharding, send/recv: the pipeline runtime moves each slice with its own
   non-blocking point-to-point transfer);
4. the action lists of the schedule, checked by the dry run, and the predicted step time of
   every schedule by the discrete-event simulation (cost_models.schedule).
"""

from __future__ import annotations

import logging
from typing import Sequence

from hetsynth.cost_models.flows import NicModel
from hetsynth.cost_models.precision import costed, costed_cluster
from hetsynth.cost_models.schedule import Timeline, simulate_schedule
from hetsynth.instruction_set.cluster import ClusterSpec
from hetsynth.instruction_set.graph import ReferenceGraph
from hetsynth.instruction_set.layouts import P, R, Layout
from hetsynth.instruction_set.mesh import Mesh
from hetsynth.instruction_set.mixed_precision import PrecisionPolicy
from hetsynth.instruction_set.models import ModelSpec
from hetsynth.instruction_set.pipeline import Boundary, Pipeline, PipelinePrediction, PipelineStage, PredictedEvent
from hetsynth.instruction_set.plan import Plan, PlanShape
from hetsynth.instruction_set.program import FUSED_MATMULS
from hetsynth.instruction_set.reshard_sides import Placed, reshard_spec
from hetsynth.instruction_set.resharding import ReshardMethod
from hetsynth.instruction_set.schedule import Link, Schedule, build_actions, check_actions
from hetsynth.instruction_set.stages import boundary_outputs, stage_graph
from hetsynth.planner.microbatch import MeasureAt, micro_batch_sizes, micro_graphs
from hetsynth.planner.planner import _evaluate, finalize, make_plan, model_info, shard_table, without_fusion
from hetsynth.planner import stage_times
from hetsynth.planner.resharding import plan_reshard
from hetsynth.planner.stage_dp import stage_memory
from hetsynth.planner.stage_reuse import StagePrograms

log = logging.getLogger(__name__)

StageChoice = tuple[range, tuple[int, int]]  # (ranks, [start, stop) over graph.calls)


class MixedSizesError(ValueError):
    """No stage program runs at every micro-batch size (the runtime needs one program)."""


def program_at(graph: ReferenceGraph, cluster: ClusterSpec, plan: Plan) -> Plan:
    """`plan`'s program and ratios on `graph` (the same stage at another micro-batch size),
    costed as the plan's precision policy costs it (cost_models.precision)."""
    found = _evaluate(*costed(graph, cluster, plan.precision_policy()), plan.sharding_ratios, plan.instructions)
    pb = found.problem
    return plan.model_copy(update={
        "model": model_info(graph), "graph": graph, "shards": shard_table(pb, found.program),
        "instructions": finalize(pb, found.program), "predicted": found.prediction,
        "gradient_sync": found.sync})


def _synthesized(graph: ReferenceGraph, cluster: ClusterSpec, ratios: Sequence[float] | None, width: int,
                 policy: PrecisionPolicy) -> Plan:
    made = make_plan(graph, cluster, ratios=ratios, width=width, progress=False,
                     with_baselines=False, allow_zero=False,  # the pipeline runtime keeps optimizer state whole
                     precision=policy.precision, reduce_dtype=policy.reduce_dtype)
    if any(i.kind in FUSED_MATMULS for i in made.instructions):
        made = without_fusion(made)  # the pipeline executor runs no fused collective-matmuls (not tested there)
    return made


def _stage_plans(graphs: dict[int, ReferenceGraph], cluster: ClusterSpec, calls: tuple[int, int],
                 ratios: Sequence[float] | None, width: int, policy: PrecisionPolicy,
                 programs: StagePrograms) -> dict[int, Plan]:
    """The stage's program synthesized at the largest micro-batch size and derived at the
    others; else synthesized at the smallest (the largest's may shard a dim that is 1 at the
    smallest, such as the batch of a micro-batch of one: no rule shards a dim of 1). Each
    stage is planned under the whole plan's precision `policy` on its own sub-cluster (its kinds'
    compute dtypes, so their rates, are the ones the whole cluster's policy gives them; its
    gradients reduced in the policy's dtype). A stage of the same structure on the same kind of
    sub-cluster as one planned before reuses its program (planner.stage_reuse)."""
    failed = []
    for size in sorted({max(graphs), min(graphs)}, reverse=True):
        graph = stage_graph(graphs[size], *calls)
        first = programs.plan(graph, cluster, (None if ratios is None else tuple(ratios), width, policy.model_dump_json()),
                              lambda: _synthesized(graph, cluster, ratios, width, policy), program_at)
        try:
            others = {b: program_at(stage_graph(g, *calls), cluster, first) for b, g in graphs.items() if b != size}
        except ValueError as err:
            failed.append(f"the program synthesized at {size} samples: {err}")
            continue
        return {size: first} | others
    raise MixedSizesError(f"stage of calls {list(calls)}: no program runs at every micro-batch size {sorted(graphs)} "
                          f"({'; '.join(failed)}); choose a micro-batch count that divides the batch")


def held_layout(plan: Plan, tensor: str) -> Layout:
    """The layout the stage program computes `tensor` in (a resharding source)."""
    for ins in plan.instructions:
        if ins.kind == "compute" and ins.node == tensor:
            return ins.layout
    raise ValueError(f"the stage program does not compute {tensor!r}")


def loaded_layouts(plan: Plan, tensor: str) -> list[Layout]:
    """The layouts the stage program loads the input `tensor` in."""
    return [ins.layout for ins in plan.instructions if ins.kind == "input" and ins.tensor == tensor]


def _placed(stage: PipelineStage, plan: Plan, tensor: str, layout: Layout) -> Placed:
    mesh = plan.mesh
    shifted = Mesh(mesh.num_nodes, mesh.per_node, mesh.two_level, stage.first_rank)
    return Placed(shifted, layout, plan.shards.get(tensor, {}).get(layout, {}) if layout.is_shard else {})


def _boundaries(stages: Sequence[PipelineStage], cluster: ClusterSpec) -> tuple[Boundary, ...]:
    producer = {t: s.index for s in stages for t in s.outputs}
    nics, hosts = NicModel.from_cluster(cluster), cluster.rank_nodes()
    out = []
    for dst in stages:
        for tensor in dst.inputs:
            src = stages[producer[tensor]]
            some = next(iter(dst.plans.values()))
            for layout in loaded_layouts(some, tensor):
                held = held_layout(next(iter(src.plans.values())), tensor)
                out.append(Boundary(tensor=tensor, src_stage=src.index, dst_stage=dst.index, src_layout=held,
                                    dst_layout=layout, reshard={
                                        b: _reshard(src, dst, b, tensor, held, layout, nics, hosts) for b in dst.plans}))
    return tuple(out)


def _reshard(src: PipelineStage, dst: PipelineStage, b: int, tensor: str, held: Layout, layout: Layout,
             nics: NicModel, hosts: Sequence[int]):
    """The send/recv resharding plan at micro-batch size b. A 0-d Partial source (a scalar
    such as MoE's running auxiliary loss) cannot be reduce-scattered: the runtime all-reduces
    it on the source stage first, so the plan moves it from R."""
    sp, dp = src.plans[b], dst.plans[b]
    meta = sp.graph.node(tensor).out
    if held is P and not meta.shape:
        held = R
    spec = reshard_spec(tensor, meta.shape, meta.dtype, meta.nbytes // max(meta.numel, 1),
                        _placed(src, sp, tensor, held), _placed(dst, dp, tensor, layout), hosts)
    return plan_reshard(spec, nics, method=ReshardMethod.SEND_RECV)


def _stage(index: int, choice: StageChoice, graphs: dict[int, ReferenceGraph], cluster: ClusterSpec,
           ratios: Sequence[float] | None, width: int, policy: PrecisionPolicy,
           programs: StagePrograms) -> PipelineStage:
    ranks, calls = choice
    full = next(iter(graphs.values()))
    plans = _stage_plans(graphs, cluster.subset(ranks), calls, ratios, width, policy, programs)
    g = next(iter(plans.values())).graph
    inputs = tuple(n.name for n in g.nodes if n.op == "input" and full.node(n.name).op == "call"
                   and g.node(n.name).op == "input" and n.name in {c.name for c in full.calls[:calls[0]]})
    return PipelineStage(index=index, first_rank=ranks.start, num_devices=len(ranks), calls=calls, inputs=inputs,
                         outputs=boundary_outputs(full, *calls) if calls[1] < len(full.calls) else (), plans=plans)


def prediction(stages: Sequence[PipelineStage], boundaries: Sequence[Boundary], sizes: Sequence[int],
               schedule: Schedule, cluster: ClusterSpec,
               others: dict[str, float] | None = None) -> PipelinePrediction:
    """The step time, the busiest stage's idle time and the timeline under `schedule`: the simulation
    (cost_models.schedule) of the stages' per-micro-batch phases and the boundary transfers on
    their NICs (planner.stage_times). `others`: the other schedules' step times when known, else
    simulated here from the same stage times (they do not depend on the schedule)."""
    links = [Link(src=b.src_stage, dst=b.dst_stage) for b in boundaries]
    hosts = cluster.rank_nodes()
    transfers = {(i, d): tuple(bd.reshard[b].predicted_s for b in sizes) for i, bd in enumerate(boundaries) for d in "FB"}
    nics = {(i, d): stage_times.nics(bd, max(sizes), hosts, d) for i, bd in enumerate(boundaries) for d in "FB"}
    cpus = stage_times.boundary_cpus(stages, boundaries, sizes)
    times = stage_times.stage_times(stages, boundaries, sizes, cpus)
    received = stage_times.receive_cpu(cpus)
    ends = {"global_s": stage_times.global_s(cluster), "shared_s": stage_times.shared_s(stages, cluster)}

    def simulate(s: Schedule) -> Timeline:
        return simulate_schedule(build_actions(s, len(sizes), links, len(stages)), times, links, transfers,
                                 resources=nics, receive_cpu=received, **ends)

    timeline = simulate(schedule)
    if others is None:
        others = {str(s): simulate(s).step_time_s for s in Schedule if s is not schedule}
    busiest = max(range(len(stages)), key=timeline.busy_s)
    events = tuple(PredictedEvent(stage=e.stage, kind=e.kind, micro_batch=e.micro_batch, start_s=e.start_s,
                                  end_s=e.end_s, boundary=e.boundary) for e in timeline.events)
    merged = others | {str(schedule): timeline.step_time_s}
    return PipelinePrediction(step_time_s=timeline.step_time_s, bubble_s=timeline.step_time_s - timeline.busy_s(busiest),
                              schedules={str(s): merged[str(s)] for s in Schedule if str(s) in merged}, timeline=events)


def make_pipeline_plan(spmd: Plan, spec: ModelSpec, stages: Sequence[StageChoice], *, num_micro: int,
                       schedule: Schedule = Schedule.EAGER_1F1B, ratios: Sequence[Sequence[float] | None] | None = None,
                       width: int = 64, measure: MeasureAt | None = None,
                       programs: StagePrograms | None = None) -> Plan:
    """`spmd` (the best SPMD plan of the model on the whole cluster) with the pipeline of the
    given stage choice, shape pipeline (module docstring). `measure` times the ops of each
    micro-batch size (planner.microbatch.micro_graphs). `programs`: stage plans to reuse
    (shared by the candidates of one choice of stages, planner.stage_reuse). The stages are planned under `spmd`'s
    precision policy; boundary tensors travel in the model's dtype (runtime.pipeline), so their
    transfers are costed at its width."""
    cluster, full = spmd.cluster, spmd.graph
    try:
        sizes = micro_batch_sizes(spmd.model.batch_size, num_micro)
        graphs, found = micro_graphs(spec, full, sizes, measure)
        coupled = ""
    except ValueError as err:
        if num_micro == 1:
            raise
        sizes, coupled = (spmd.model.batch_size,), str(err)
        graphs, found = micro_graphs(spec, full, sizes)
        log.warning("%s", err)
    ratios = ratios or [None] * len(stages)
    policy = spmd.precision_policy()
    programs = StagePrograms() if programs is None else programs
    built = [_stage(i, c, graphs, cluster, ratios[i], width, policy, programs) for i, c in enumerate(stages)]
    boundaries = _boundaries(built, cluster)
    links = [Link(src=b.src_stage, dst=b.dst_stage) for b in boundaries]
    actions = build_actions(schedule, len(sizes), links, len(built))
    check_actions(actions, links, len(sizes))
    pipeline = Pipeline(stages=tuple(built), boundaries=boundaries, micro_batches=tuple(sizes), schedule=schedule,
                        actions=actions, statistics=found.statistics, coupled=coupled,
                        predicted=prediction(built, boundaries, sizes, schedule, cluster))
    return spmd.model_copy(update={"shape": PlanShape.PIPELINE, "pipeline": pipeline})


def block_starts(graph: ReferenceGraph) -> list[int]:
    """Call indices where a numbered block (`blocks.3`, `features.12`) begins: the cuts a
    stage choice may use."""
    import re
    out, prev = [], None
    for i, node in enumerate(graph.calls):
        m = re.match(r"^(.*?\.\d+)(\.|$)", node.module_path or "")
        block = m.group(1) if m else None
        if block is not None and block != prev and i > 0:
            out.append(i)
        prev = block if block is not None else prev
    return out


def with_schedule(plan: Plan, schedule: Schedule) -> Plan:
    """The same pipeline (stages, micro-batches) under another schedule, its actions checked
    by the dry run and its prediction the simulation's for that schedule."""
    p = plan.pipeline
    if p is None:
        raise ValueError("with_schedule needs a pipeline plan")
    actions = build_actions(schedule, len(p.micro_batches), p.links, len(p.stages))
    predicted = prediction(p.stages, p.boundaries, p.micro_batches, schedule, plan.cluster, p.predicted.schedules)
    return plan.model_copy(update={"pipeline": Pipeline.model_validate(
        p.model_copy(update={"schedule": schedule, "actions": actions, "predicted": predicted}).model_dump())})


# -- stage choices: a simple one for a given S, the dynamic programme's (auto_stages) --------------

def rank_groups(cluster: ClusterSpec, num_stages: int) -> list[range]:
    """Contiguous rank ranges: whole nodes when there are at least as many nodes as stages
    (consecutive nodes joined, balanced by device count), else equal runs of devices."""
    sizes = [len(n.devices) for n in cluster.nodes]
    if not 1 <= num_stages <= cluster.num_devices:
        raise ValueError(f"--stages {num_stages}: cluster {cluster.name!r} has {cluster.num_devices} devices; "
                         f"choose 1..{cluster.num_devices}")
    if num_stages <= len(sizes):
        bounds = [round(len(sizes) * k / num_stages) for k in range(num_stages + 1)]
        starts = [sum(sizes[:b]) for b in bounds]
    else:
        starts = [round(cluster.num_devices * k / num_stages) for k in range(num_stages + 1)]
    return [range(a, b) for a, b in zip(starts, starts[1:])]


def balanced_cuts(graph: ReferenceGraph, weights: Sequence[float]) -> list[tuple[int, int]]:
    """Call ranges cut at block starts so that stage s gets about weights[s] of the FLOPs."""
    calls, starts = graph.calls, block_starts(graph)
    if len(starts) < len(weights) - 1:
        raise ValueError(f"{len(weights)} stages: {graph.model_ref} has {len(starts) + 1} blocks to cut between; "
                         f"choose at most {len(starts) + 1} stages")
    flops = [n.flops_fwd + n.flops_bwd for n in calls]
    prefix = [sum(flops[:i]) for i in starts]
    total, cuts, at = sum(flops), [], -1
    for k in range(1, len(weights)):
        target = total * sum(weights[:k]) / sum(weights)
        options = [j for j in range(at + 1, len(starts) - (len(weights) - 1 - k))]
        at = min(options, key=lambda j: abs(prefix[j] - target))
        cuts.append(starts[at])
    edges = [0, *cuts, len(calls)]
    return list(zip(edges, edges[1:]))


def plan_stages(spmd: Plan, spec: ModelSpec, num_stages: int, *, num_micro: int | None = None,
                schedule: Schedule | None = None, width: int = 64, measure: MeasureAt | None = None) -> Plan:
    """A pipeline of `num_stages` stages (`rank_groups`, `balanced_cuts` by the groups'
    throughputs), with the micro-batch count (of S, 2S, 4S within the batch, unless given) and
    the schedule (unless given) the simulation predicts fastest of those that fit. The plan's
    shape is the pipeline when it is predicted faster than the SPMD plan by more than 2 % or only
    it fits. Cuts follow the groups' throughputs at the policy's compute dtypes."""
    cluster = spmd.cluster
    groups = rank_groups(cluster, num_stages)
    speeds = costed_cluster(cluster, spmd.precision_policy()).throughputs_flops()
    cuts = balanced_cuts(spmd.graph, [sum(speeds[r] for r in g) for g in groups])
    batch = spmd.model.batch_size
    counts = [num_micro] if num_micro else sorted({m for m in (num_stages, 2 * num_stages, 4 * num_stages) if m <= batch} or {batch})
    return _choose_shape(spmd, _best_pipeline(spmd, spec, [(list(zip(groups, cuts)), counts)], schedule, width, measure))


def auto_stages(spmd: Plan, spec: ModelSpec, *, num_micro: int | None = None, schedule: Schedule | None = None,
                max_stages: int = 8, top_k: int = 2, width: int = 64, measure: MeasureAt | None = None) -> Plan:
    """The stage choice of the dynamic programme (planner.stage_dp: stages, cuts at block
    starts, sub-meshes, M and schedule by its estimate), its `top_k` candidates synthesized
    and simulated, the fastest kept; the shape as in `plan_stages`. The SPMD plan unchanged
    when no candidate fits the estimate's memory or the model has no blocks to cut between. The
    dynamic programme estimates on the graph and cluster as the precision policy costs them."""
    from hetsynth.planner.stage_dp import choose_stages

    batch = spmd.model.batch_size
    graph, cluster = costed(spmd.graph, spmd.cluster, spmd.precision_policy())
    found = choose_stages(graph, cluster, block_starts(spmd.graph), batch=batch, max_stages=max_stages,
                          schedules=[schedule] if schedule else tuple(Schedule), top_k=top_k,
                          num_micro=num_micro)
    if not found:
        log.warning("no pipeline of 2..%d stages fits the memory estimate; keeping the SPMD plan", max_stages)
        return spmd
    for c in found:
        log.info("stage candidate: %s", c.describe())
    tries = [(list(c.stages), [c.num_micro]) for c in found]
    return _choose_shape(spmd, _best_pipeline(spmd, spec, tries, schedule, width, measure))


def _best_pipeline(spmd: Plan, spec: ModelSpec, tries: Sequence[tuple[list[StageChoice], Sequence[int]]],
                   schedule: Schedule | None, width: int, measure: MeasureAt | None = None) -> Plan:
    """The fastest of the given stage choices and micro-batch counts that fits memory (the
    fastest when none does), each under the given schedule or the fastest one that fits."""
    best: Plan | None = None
    skipped: MixedSizesError | None = None
    programs = StagePrograms()
    for choice, counts in tries:
        for m in counts:
            try:
                made = make_pipeline_plan(spmd, spec, choice, num_micro=m, width=width, measure=measure,
                                          programs=programs)
            except MixedSizesError as err:
                log.warning("%d micro-batches skipped: %s", m, err)
                skipped = err
                continue
            candidate = _scheduled(made, schedule)
            if best is None or _rank(candidate) < _rank(best):
                best = candidate
            if candidate.pipeline.coupled:  # one micro-batch whatever was asked
                break
    if programs.hits:
        log.info("%d stage plan(s) reused from a stage of the same structure", programs.hits)
    if best is None:
        assert skipped is not None
        raise skipped
    return best


def _scheduled(candidate: Plan, schedule: Schedule | None) -> Plan:
    """The pipeline under `schedule`, else under the fastest schedule whose stages fit memory
    (GPipe holds all M micro-batches' activations: often the fastest, not always one that
    fits), else under the fastest."""
    p = candidate.pipeline
    options = [schedule] if schedule else sorted(Schedule, key=lambda s: p.predicted.schedules[str(s)])
    under = lambda s: candidate.model_copy(update={"pipeline": p.model_copy(update={"schedule": s})})  # noqa: E731
    pick = next((s for s in options if _fits(under(s))), options[0])
    return with_schedule(candidate, pick) if pick is not p.schedule else candidate


def _fits(plan: Plan) -> bool:
    return all(peak <= cap for peak, cap, _ in stage_memory(plan))


def _rank(plan: Plan) -> tuple[bool, float]:
    return not _fits(plan), plan.pipeline.predicted.step_time_s


def _choose_shape(spmd: Plan, best: Plan) -> Plan:
    """Pipeline when it fits (`stage_memory`) and is predicted faster than SPMD by more than
    2 % or SPMD does not fit."""
    faster = best.pipeline.predicted.step_time_s < spmd.predicted.step_time_s * 0.98
    fits = _fits(best)
    shape = PlanShape.PIPELINE if fits and (faster or not spmd.predicted.fits) else PlanShape.SPMD
    return best.model_copy(update={"shape": shape})
