"""The public functions of `hetsynth` (capture_model, plan, capture_measured), in a module of their
own so that `import hetsynth` (and every `hetsynth.runtime...` import a torchrun worker makes)
loads none of them until used: hetsynth/__init__.py resolves its names lazily (PEP 562)."""


from __future__ import annotations

import dataclasses
import math
import os
from typing import Mapping, Sequence

import torch
from torch import nn

from hetsynth.instruction_set.cluster import ClusterSpec, load_cluster
from hetsynth.instruction_set.graph import ReferenceGraph
from hetsynth.instruction_set.plan import Plan, PlanShape
from hetsynth.plan_shape import Stages, check_pipeline_options, checked_stages, stages_to_try, with_pipeline

from hetsynth import plan_cache

def capture_model(model: str | nn.Module, example_inputs: Sequence[torch.Tensor] | None = None, *,
                  allow_replicate_fallback: bool = False, model_ref: str | None = None) -> ReferenceGraph:
    """Capture a model reference (`gpt:tiny`) or a module with its example inputs. A module's
    graph names it by `model_ref` (a reference that builds it, e.g. `net.py:make`, so that
    `hetsynth run` can), or else by its class name."""
    from hetsynth.instruction_set.models import parse_model_ref
    from hetsynth.planner.capture import capture, capture_spec

    if isinstance(model, str) and model_ref is not None:
        raise ValueError(f"model_ref {model_ref!r} applies to a module; {model!r} is a model reference already")
    if isinstance(model, str):
        return capture_spec(parse_model_ref(model), allow_replicate_fallback=allow_replicate_fallback)
    if example_inputs is None:
        raise ValueError("capture_model(module, example_inputs): example_inputs are required for a module")
    if model_ref is not None:
        parse_model_ref(model_ref)  # a reference that does not resolve fails here, not on the ranks
    return capture(model, example_inputs, model_ref=model_ref or type(model).__name__,
                   allow_replicate_fallback=allow_replicate_fallback)


def plan(model: str | nn.Module, example_inputs: Sequence[torch.Tensor] | None = None,
         cluster: ClusterSpec | str | os.PathLike | None = None, *, batch_size: int | None = None,
         num_devices: int | None = None, ratios: Sequence[float] | None = None,
         allow_replicate_fallback: bool = False, progress: bool = False,
         measure_ops: bool = False, data_parallel: bool = False, bucket_mb: float | None = None,
         fusion: bool = True, keep_unfit: bool = False, zero: str = "auto", model_ref: str | None = None,
         precision: str = "fp32", reduce_dtype: str = "float32", cache: bool = False,
         expert_loads: Sequence[float] | Mapping[str, Sequence[float]] | None = None,
         stages: int | str | None = None, micro_batches: int | None = None, schedule: str | None = None) -> Plan:
    """Synthesize a Plan for a model reference or a module with its example inputs.
    `measure_ops` times the model's ops on this machine (profiling.op_profile): for clusters of
    this machine's CPUs, such as the emulated one (a model reference is then also timed on
    the emulated devices, profiling.model_timing). `data_parallel` searches only data-parallel
    programs (the batch split, parameters replicated); the ratios, the collective variants and
    SFB are still the cost model's choices. `bucket_mb` forces the gradient bucket cap (MiB;
    default: the cap the cost model predicts fastest). `fusion` False keeps every all-gather ->
    linear and linear -> reduce-scatter as its plain pair (planner.fusions). `keep_unfit`: when
    no program fits in memory, the one closest to fitting (`predicted.fits` False) instead of
    PlanInfeasible (where pipelines are considered, `stages` below, one that fits is returned first). `zero`: "auto"
    shards training state (ZeRO-1/2/3) only where memory binds, "0" never, "1", "2" or "3" every
    parameter that can be at that stage, at the state LP's rows (planner.zero). `model_ref`: for a
    module, the model reference recorded in the plan (capture_model), so that `hetsynth run` can
    build it. `precision`: "fp32", "bf16", "fp16" or "auto" (per device kind the fastest type its
    spec's matmul_flops gives; instruction_set.mixed_precision): what each kind computes in, with
    float32 master weights and gradient reduction; the plan records it and is costed at those
    rates (a kind without the type asked for is a ValueError naming it). `reduce_dtype`: "float32"
    (default) or "bfloat16", the dtype gradients are reduced in (half the gradient traffic;
    instruction_set.mixed_precision). `cache`: return the plan
    cached for the same inputs and cache a new one (hetsynth.plan_cache; a model reference is
    looked up before capture, a module after it; never with `measure_ops`). `expert_loads`: for
    MoE models (routed experts), each expert's expected share of the routed tokens, as one list
    for every MoE layer or {op name or module path: list} (instruction_set.experts_op.
    with_expert_loads; default uniform): they price the expert split, not the placement.
    `stages`: which pipelines are considered beside the SPMD plan (hetsynth.plan_shape): None
    (default) "auto" on a cluster of several nodes or when no SPMD plan fits, for a model
    reference (or a module with `model_ref`) without fixed ratios, data_parallel or a forced
    ZeRO stage; 1 the SPMD plan only; "auto" the stage DP's choice; N that many stages. The
    pipeline is kept when it fits and is predicted more than 2 % faster, or only it fits
    (`plan.shape`); `micro_batches` and `schedule` ("gpipe", "1f1b", "eager_1f1b") fix the
    pipeline's (default: the fastest predicted)."""
    from hetsynth.cost_models.precision import costed
    from hetsynth.instruction_set.experts_op import with_expert_loads
    from hetsynth.instruction_set.mixed_precision import choose_policy
    from hetsynth.instruction_set.models import parse_model_ref, with_overrides
    from hetsynth.planner.feasibility import check_memory_lower_bound
    from hetsynth.planner.planner import DP_SEED, make_plan
    from hetsynth.planner.problem import Restrictions

    if cluster is None:
        raise ValueError("plan() needs a cluster (a ClusterSpec or a spec file path)")
    if zero not in ZERO_CHOICES:
        raise ValueError(f"zero {zero!r}: use one of {', '.join(ZERO_CHOICES)}")
    if bucket_mb is not None and not (math.isfinite(bucket_mb) and bucket_mb * 2**20 >= 1):
        raise ValueError(f"bucket cap {bucket_mb} MiB: must be a finite number of at least one byte (2**-20 MiB)")
    spec = load_cluster(cluster) if isinstance(cluster, (str, os.PathLike)) else cluster
    if num_devices is not None:
        spec = spec.first(num_devices)
    stages = checked_stages(stages, spec.num_devices)
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    check_pipeline_options(stages, micro_batches, schedule, zero=zero,
                           pipelinable=isinstance(model, str) or model_ref is not None)
    policy = choose_policy(spec, precision, reduce_dtype)  # a kind without the precision asked for fails before capture
    if isinstance(model, str) and model_ref is not None:
        raise ValueError(f"model_ref {model_ref!r} applies to a module; {model!r} is a model reference already")
    options = {"face": "api", "batch_size": batch_size, "ratios": list(ratios) if ratios is not None else None,
               "allow_replicate_fallback": allow_replicate_fallback, "data_parallel": data_parallel,
               "bucket_mb": bucket_mb, "fusion": fusion, "keep_unfit": keep_unfit, "zero": zero,
               "precision": precision, "reduce_dtype": reduce_dtype, "expert_loads": expert_loads,
               "stages": stages, "micro_batches": micro_batches, "schedule": schedule}
    cache = cache and not measure_ops
    key = plan_cache.ref_key(model, spec, options) if cache and isinstance(model, str) else None
    if key is not None and (hit := _cached(key)) is not None:
        return hit
    if isinstance(model, str):
        ref = parse_model_ref(model)
        if batch_size is not None:
            ref = with_overrides(ref, batch_size=batch_size)
        graph = capture_model(ref.ref, allow_replicate_fallback=allow_replicate_fallback)
        check_memory_lower_bound(*costed(graph, spec, policy))  # before timing anything
        if measure_ops:
            graph = capture_measured(ref.ref, allow_replicate_fallback=allow_replicate_fallback, cluster=spec)
    else:
        if example_inputs is None:
            raise ValueError("plan(module, example_inputs, cluster): example_inputs are required")
        if batch_size is not None:
            raise ValueError("batch_size applies to model references; slice example_inputs instead")
        graph = capture_model(model, example_inputs, allow_replicate_fallback=allow_replicate_fallback,
                              model_ref=model_ref)
        check_memory_lower_bound(*costed(graph, spec, policy))
        key = plan_cache.graph_key(graph, spec, options) if cache else None
        if key is not None and (hit := _cached(key)) is not None:
            return hit
        if measure_ops:
            if any(t.is_meta for t in example_inputs):
                raise ValueError("measure_ops needs real example inputs (not on the meta device)")
            from hetsynth.profiling.measured import measured

            graph = measured(graph, model, example_inputs)
    if expert_loads is not None:
        graph = with_expert_loads(graph, expert_loads)
    restrictions = DP_SEED if data_parallel else None
    if not fusion:
        restrictions = dataclasses.replace(restrictions or Restrictions(), allow_fusion=False)
    if zero == "0":
        restrictions = dataclasses.replace(restrictions or Restrictions(), allow_zero=False)
    restricted = (f"zero {zero}" if zero not in ("auto", "0") else "ratios fixed" if ratios is not None else
                  "data_parallel" if data_parallel else None if isinstance(model, str) else "a module")
    pipelinable = isinstance(model, str) or model_ref is not None
    may_pipeline = pipelinable and stages != 1  # a forced ZeRO stage: PlanInfeasible below says why none is tried
    made = make_plan(graph, spec, ratios=ratios, progress=progress, restrictions=restrictions,
                     bucket_cap=round(bucket_mb * 2**20) if bucket_mb is not None else None,
                     keep_unfit=keep_unfit or may_pipeline, precision=precision, reduce_dtype=reduce_dtype)
    made = made if zero in ("auto", "0") else _forced_zero(made, int(zero))
    made = _shaped(made, stages, keep_unfit=keep_unfit, pipelinable=pipelinable,
                   restricted=restricted, micro_batches=micro_batches, schedule=schedule, measure_ops=measure_ops,
                   progress=progress)
    if key is not None:
        plan_cache.store(key, made, plan_cache.model_files(model) if isinstance(model, str) else None)
    return made


def _shaped(spmd: Plan, stages: Stages, *, keep_unfit: bool, pipelinable: bool, restricted: str | None,
            micro_batches: int | None, schedule: str | None, measure_ops: bool, progress: bool) -> Plan:
    """`spmd` or a pipeline of it (hetsynth.plan_shape); PlanInfeasible when neither fits,
    unless `keep_unfit`."""
    from hetsynth.planner.feasibility import PlanInfeasible
    from hetsynth.planner.planner import shortfall_message

    to_try = stages_to_try(spmd, stages, pipelinable=pipelinable, restricted=restricted,
                           micro_batches=micro_batches, schedule=schedule, progress=progress)
    made, tried = spmd, None
    if to_try is not None:
        made, tried = with_pipeline(spmd, to_try, micro_batches=micro_batches, schedule=schedule,
                                    measure_ops=measure_ops)
    if keep_unfit or made.shape is PlanShape.PIPELINE or made.predicted.fits:
        return made
    if tried is None and restricted is not None and restricted.startswith("zero") and pipelinable:
        raise PlanInfeasible(f"{shortfall_message(spmd)}. With {restricted} no pipeline is tried (the pipeline "
                             f"runtime keeps every stage's training state whole); use zero auto")
    raise PlanInfeasible(shortfall_message(spmd) + (f". No pipeline fits either: {tried}" if tried else ""))


def _cached(key: "plan_cache.CacheKey") -> Plan | None:
    hit = plan_cache.lookup(key)
    return hit.plan if hit is not None else None


ZERO_CHOICES = ("auto", "0", "1", "2", "3")
SCHEDULES = ("gpipe", "1f1b", "eager_1f1b")


def _forced_zero(plan: Plan, stage: int) -> Plan:
    """Every parameter that can be at ZeRO stage `stage` put there (planner.planner.with_zero)."""
    from hetsynth.instruction_set.training_state import TrainingState
    from hetsynth.planner.planner import with_zero

    state = (TrainingState.ZERO1, TrainingState.ZERO2, TrainingState.ZERO3)[stage - 1]
    forced = with_zero(plan, None, state)
    if not any(i.kind == "param" and i.state == state for i in forced.instructions):
        raise ValueError(f"zero {stage}: no parameter of this plan can be at ZeRO stage {stage} (it shards the state "
                         f"of replicated parameters{', read by plain compute ops only' if stage == 3 else ''}); "
                         f"use --zero auto")
    return forced


def capture_measured(ref: str, *, allow_replicate_fallback: bool = False,
                     cluster: ClusterSpec | None = None) -> ReferenceGraph:
    """capture_model(ref) with the model's ops and optimizer step timed on this machine, on
    its own initialisation and first batch (profiling.op_profile; `hetsynth plan --measure-ops`).
    With a `cluster` that is emulated here, the model is also timed on its devices
    (profiling.model_timing) and the graph records each device kind's factor."""
    from hetsynth.profiling.measured import capture_measured as measured_graph

    return measured_graph(ref, allow_replicate_fallback=allow_replicate_fallback, cluster=cluster)
