"""`hetsynth explain plan.json --rank R` on a pipeline plan: the rank's stage, its program (the
stage's SPMD program at the largest micro-batch size, on the stage's sub-mesh), the boundary
transfers this rank takes part in, and its action list."""

from __future__ import annotations

from hetsynth.instruction_set.pipeline import Pipeline
from hetsynth.instruction_set.plan import Plan, PlanError
from hetsynth.runtime.codegen import build_rank_program
from hetsynth.runtime.groups import Groups
from hetsynth.runtime.pipeline.trainer import _outputs, stage_mesh


def _transfers(pipeline: Pipeline, rank: int) -> list[str]:
    lines = []
    for i, bd in enumerate(pipeline.boundaries):
        plan = bd.reshard[max(bd.reshard)]
        for chain in plan.chains:
            if rank in chain.members and len(chain.members) == 2:
                src, dst = chain.members
                box = " x ".join(f"[{a}:{b})" for a, b in zip(chain.box.start, chain.box.stop)) or "scalar"
                what = f"sends {box} to rank {dst}" if rank == src else f"receives {box} from rank {src}"
                lines.append(f"  boundary {i}: {bd.tensor} stage {bd.src_stage} ({bd.src_layout}) -> stage "
                             f"{bd.dst_stage} ({bd.dst_layout}), {plan.method.value}: this rank {what}")
    return lines or ["  none"]


def explain_pipeline(plan: Plan, rank: int) -> str:
    pipeline = plan.pipeline
    assert pipeline is not None
    n = plan.cluster.num_devices
    if not 0 <= rank < n:
        raise PlanError(f"--rank {rank}: the plan has {n} ranks (0..{n - 1})")
    stage = pipeline.stage_of(rank)
    mesh = stage_mesh(stage)
    size = max(stage.plans)
    splan = stage.plans[size]
    program = build_rank_program(splan, Groups.local_only(mesh, rank), outputs=_outputs(pipeline, stage))
    member = mesh.index(rank)
    head = (f"rank {rank}: stage {stage.index} of {len(pipeline.stages)} — ranks {stage.ranks[0]}-{stage.ranks[-1]}, "
            f"calls {stage.calls[0]}-{stage.calls[1] - 1}; member {member} of {stage.num_devices}, "
            f"ratio {splan.sharding_ratios[member]:.4f}")
    sched = (f"schedule {pipeline.schedule.value}, {len(pipeline.micro_batches)} micro-batches "
             f"{list(pipeline.micro_batches)}; predicted {pipeline.predicted.step_time_s * 1e3:.2f} ms/step "
             f"({', '.join(f'{k} {v * 1e3:.2f}' for k, v in pipeline.predicted.schedules.items())})")
    notes = [f"one micro-batch: {pipeline.coupled}"] if pipeline.coupled else []
    stats = f"statistics from the whole batch: {', '.join(pipeline.statistics) or 'none'}"
    actions = [f"  {i:3d} {a}" for i, a in enumerate(pipeline.actions[stage.index])]
    return "\n".join([head, sched, *notes, stats, "", f"stage program (micro-batch size {size}, torch.fx):",
                      program.module.code.strip(), "", "boundary transfers:", *_transfers(pipeline, rank), "",
                      "actions (this rank):", *actions])
