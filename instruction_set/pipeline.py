"""A pipeline plan as data: stages on sub-meshes, their boundaries, micro-batches, schedule.

- `PipelineStage`: the contiguous calls [start, stop) of the reference graph that the stage
  computes, on the contiguous ranks [first_rank, first_rank + size); `plans[b]` is its SPMD
  plan (instruction_set.plan.Plan, on the stage's sub-cluster, ranks counted from 0 there) for
  micro-batches of b samples: the same program, ratios and parameter shard lengths at every b,
  the activations' shard lengths derived at b. Its boundary inputs are graph inputs there.
- `Boundary`: one boundary tensor from the stage that computes it to a stage that reads it,
  from the layout the source program holds it in to the layout the destination program loads
  it in, with the cross-mesh resharding plan (instruction_set.resharding) per micro-batch size.
  Its backward moves the gradient the opposite way along the same transfers.
- `statistics`: input-only batch reductions (planner.microbatch) every micro-batch program reads
  from the whole batch; `coupled`: why the graph is pipelined with one micro-batch, if it is.
- `actions[s]`: stage s's action list (instruction_set.schedule), checked by the dry run when
  the plan is made and when it is read.
- `predicted`: the step time under the chosen schedule and the others, and the chosen one's
  simulated timeline (what `hetsynth report` draws).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator

from hetsynth.instruction_set.layouts import LayoutField
from hetsynth.instruction_set.resharding import ReshardPlan
from hetsynth.instruction_set.schedule import Action, Link, Schedule, check_actions


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PipelineStage(_Frozen):
    index: int
    first_rank: int
    num_devices: int
    calls: tuple[int, int]                 # [start, stop) over graph.calls
    inputs: tuple[str, ...]                # boundary tensors it receives
    outputs: tuple[str, ...]               # boundary tensors it sends
    plans: dict[int, "Plan"]  # noqa: F821  micro-batch size -> the stage's SPMD plan (instruction_set.plan
    #                           resolves "Plan" when it defines it: this module does not import it)

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.num_devices)


class Boundary(_Frozen):
    tensor: str
    src_stage: int
    dst_stage: int
    src_layout: LayoutField
    dst_layout: LayoutField
    reshard: dict[int, ReshardPlan]        # per micro-batch size


class PredictedEvent(_Frozen):
    """One interval of the simulated step (cost_models.schedule): stage `stage` runs F or B of
    `micro_batch`, or its in-stage gradient sync (SYNC, micro_batch -1); or stage `stage` sends
    boundary `boundary`'s activation (XFER_F) or gradient (XFER_B) of `micro_batch`."""
    stage: int
    kind: str
    micro_batch: int
    start_s: float
    end_s: float
    boundary: int | None = None


class PipelinePrediction(_Frozen):
    step_time_s: float
    schedules: dict[str, float]            # every schedule's predicted step time, same stages and M
    bubble_s: float                        # idle time of the busiest stage
    timeline: tuple[PredictedEvent, ...] = ()  # the chosen schedule's simulated step


class Pipeline(_Frozen):
    stages: tuple[PipelineStage, ...]
    boundaries: tuple[Boundary, ...]
    micro_batches: tuple[int, ...]         # sizes, in order; they add up to the batch
    schedule: Schedule
    actions: tuple[tuple[Action, ...], ...]
    statistics: tuple[str, ...] = ()
    coupled: str = ""
    predicted: PipelinePrediction

    @property
    def links(self) -> list[Link]:
        return [Link(src=b.src_stage, dst=b.dst_stage) for b in self.boundaries]

    def stage_of(self, rank: int) -> PipelineStage:
        for stage in self.stages:
            if rank in stage.ranks:
                return stage
        raise ValueError(f"rank {rank} is in no stage (stages hold ranks 0..{self.stages[-1].ranks[-1]})")

    @model_validator(mode="after")
    def _consistent(self) -> "Pipeline":
        at, rank = 0, 0
        for s, stage in enumerate(self.stages):
            if stage.index != s or stage.calls[0] != at or stage.first_rank != rank or stage.calls[1] <= at:
                raise ValueError(f"stage {s} (calls {list(stage.calls)}, ranks {list(stage.ranks)}): stages must "
                                 f"cover the calls from {at} and the ranks from {rank} in order, without gaps")
            if sorted(stage.plans) != sorted(set(self.micro_batches)):
                raise ValueError(f"stage {s} has programs for micro-batch sizes {sorted(stage.plans)}, the pipeline "
                                 f"runs sizes {sorted(set(self.micro_batches))}")
            at, rank = stage.calls[1], rank + stage.num_devices
        for b in self.boundaries:
            if not 0 <= b.src_stage < b.dst_stage < len(self.stages):
                raise ValueError(f"boundary {b.tensor}: stages {b.src_stage} -> {b.dst_stage} of {len(self.stages)}")
        check_actions(self.actions, self.links, len(self.micro_batches))
        return self
