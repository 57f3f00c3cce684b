"""Which shape `hetsynth.plan` returns: the SPMD plan, or a pipeline of it (planner.pipeline).

`stages` says which pipelines are considered:

- None (the default): `"auto"` on a cluster of more than one node, and on any cluster when no
  SPMD plan fits in memory; SPMD alone otherwise. Where the SPMD plan fits, the default
  considers no pipeline when the inputs describe an SPMD plan: fixed `ratios` (one share per
  device of the whole cluster) or `data_parallel`. It never considers one for a module
  (`hetsynth.plan(module, ...)`, fitting or not: a pipeline plan trains only through
  `pm.train_step`, so the user's `loss = pm(x); loss.backward()` loop would stop working) nor
  with a forced ZeRO stage (the pipeline runtime keeps every stage's training state whole).
  Pipelines need a model reference (a module's `model_ref`): micro-batches are captured
  from it at their sizes.
- 1: the SPMD plan only.
- "auto": stages, cuts and sub-meshes by the stage DP (planner.stage_dp), its candidates
  synthesized and simulated.
- N >= 2: N stages on contiguous nodes or devices, cut by throughput.

Of the SPMD plan and the pipeline found, the pipeline is kept when it fits and is predicted
faster by more than 2 %, or when only it fits (planner.pipeline._choose_shape); the plan keeps
the other shape's prediction either way (`plan.pipeline` on an SPMD plan: `hetsynth plan`
prints both).
"""

from __future__ import annotations

import logging

from hetsynth.instruction_set.plan import Plan, PlanShape

log = logging.getLogger(__name__)

Stages = int | str | None


def checked_stages(stages: Stages, num_devices: int) -> Stages:
    """`stages` as given, or ValueError naming it and what is valid."""
    if stages is None or stages == "auto":
        return stages
    if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= num_devices:
        raise ValueError(f"stages {stages!r}: choose 'auto', 1 (SPMD only) or 2..{num_devices} (the cluster's "
                         f"devices)")
    return stages


def check_pipeline_options(stages: Stages, micro_batches: int | None, schedule: str | None, *, zero: str,
                           pipelinable: bool) -> None:
    """What can be refused before any capture: micro-batches or a schedule with stages 1, a
    micro-batch count under 1, stages asked with a forced ZeRO stage or for a module without a
    model reference."""
    if micro_batches is not None and (isinstance(micro_batches, bool) or not isinstance(micro_batches, int)
                                      or micro_batches < 1):
        raise ValueError(f"micro-batches {micro_batches!r}: choose 1..the batch size")
    if stages == 1 and (micro_batches is not None or schedule is not None):
        raise ValueError(f"micro-batches ({micro_batches}) and a schedule ({schedule}) apply to pipelines, and stages "
                         f"1 plans SPMD only; give stages 'auto' or a number of stages")
    if stages in (None, 1):
        return
    if zero not in ("auto", "0"):
        raise ValueError(f"zero {zero} with stages {stages}: the pipeline runtime keeps every stage's training state "
                         f"whole; use zero 'auto' (the SPMD plan may still use ZeRO) or drop stages")
    if not pipelinable:
        raise ValueError(f"stages {stages!r}: a pipeline captures the model again at its micro-batch sizes, which "
                         f"needs a model reference: plan the reference, or the module with model_ref=")


def stages_to_try(plan: Plan, stages: Stages, *, pipelinable: bool, restricted: str | None,
                  micro_batches: int | None, schedule: str | None, progress: bool) -> int | str | None:
    """The pipelines to consider for the SPMD `plan` (module docstring): "auto", a number of
    stages, or None for none. `pipelinable`: the model can be captured at micro-batch sizes;
    `restricted`: why the default considers none (fixed ratios, data parallel, forced ZeRO), or
    None."""
    found = _stages_to_try(plan, stages, pipelinable=pipelinable, restricted=restricted, progress=progress)
    if found is None and (micro_batches is not None or schedule is not None):
        raise ValueError(f"micro-batches ({micro_batches}) and a schedule ({schedule}) apply to pipelines, and none is "
                         f"considered for this plan (stages {stages}); give stages 'auto' or a number of stages")
    return found


def _stages_to_try(plan: Plan, stages: Stages, *, pipelinable: bool, restricted: str | None,
                   progress: bool) -> int | str | None:
    if stages == 1:
        return None
    if stages is not None:  # checked before capture (check_pipeline_options)
        return stages
    if not pipelinable or restricted == "a module" or (restricted or "").startswith("zero"):
        return None
    if not plan.predicted.fits:
        if progress:
            print("no SPMD plan fits in memory; trying pipeline stages (as --stages auto would)", flush=True)
        return "auto"
    if restricted is not None:
        return None
    if len(plan.cluster.nodes) == 1:
        return None
    if progress:
        log.info("considering pipeline stages too (a cluster of %d nodes; --stages 1 plans SPMD only)",
                 len(plan.cluster.nodes))
    return "auto"


def with_pipeline(plan: Plan, stages: int | str, *, micro_batches: int | None = None,
                  schedule: str | None = None, measure_ops: bool = False) -> tuple[Plan, str | None]:
    """The plan with the pipelines of `stages` considered, and when the result does not fit,
    what was tried (for PlanInfeasible's message; None when it fits)."""
    from hetsynth.instruction_set.models import parse_model_ref
    from hetsynth.instruction_set.schedule import Schedule
    from hetsynth.planner.pipeline import auto_stages, plan_stages, stage_memory

    if micro_batches is not None and not 1 <= micro_batches <= plan.model.batch_size:
        raise ValueError(f"micro-batches {micro_batches}: choose 1..{plan.model.batch_size} (the batch size)")
    order = Schedule(schedule) if schedule else None
    spec = parse_model_ref(plan.model.ref)
    measure = None
    if measure_ops:  # each micro-batch size's ops timed too (planner.microbatch)
        from hetsynth.profiling.measured import measure_at

        measure = measure_at(plan.model.ref, plan.graph)
    out = (auto_stages(plan, spec, num_micro=micro_batches, schedule=order, measure=measure)
           if stages == "auto" else
           plan_stages(plan, spec, stages, num_micro=micro_batches, schedule=order, measure=measure))
    if out.shape is PlanShape.PIPELINE or out.predicted.fits:
        return out, None
    if out.pipeline is None:
        return out, "no pipeline of 2..8 stages fits the memory estimate"
    return out, "the pipeline found does not fit either (" + "; ".join(
        f"stage {i}: {peak:.3g} of {cap:g} GiB" for i, (peak, cap, _) in enumerate(stage_memory(out))) + ")"

