"""The Plan: everything a rank needs to run its part of training, as versioned JSON.

A plan holds the reference graph, the device mesh its layouts live on, the per-device
sharding ratios, the per-tensor shard lengths (derived once, instruction_set.shards), the
distributed program, the predicted step time and per-device compute / communication /
memory, the same predictions for the baselines, the gradient buckets
(instruction_set.sync), and statistics of the synthesis. It contains
no torch objects; the runtime resolves it against real process groups.

The format is versioned (`PLAN_VERSION`; `PLAN_CHANGES` says what each version changed). A
plan of an older version that the current one can express is converted when it is read, and
a warning says so; any other version is refused with an error saying how to make a new plan.
"""

from __future__ import annotations

import copy
import json
import logging
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hetsynth.instruction_set.cluster import ClusterSpec
from hetsynth.instruction_set.files import write_atomic
from hetsynth.instruction_set.graph import ReferenceGraph
from hetsynth.instruction_set.layouts import Layout
from hetsynth.instruction_set.mesh import Mesh
from hetsynth.instruction_set.mixed_precision import PrecisionPolicy, choose_policy
from hetsynth.instruction_set.pipeline import Pipeline, PipelineStage
from hetsynth.instruction_set.plan_checks import PlanParts, ShardTable, check_plan
from hetsynth.instruction_set.program import Instruction
from hetsynth.instruction_set.shards import MeshLayout
from hetsynth.instruction_set.training_state import StateShards, TrainingState, check_state_shards, check_states
from hetsynth.instruction_set.sync import DEFAULT_BUCKET_CAP_BYTES, GradBucket, GradientSync, assign_buckets, check_buckets

log = logging.getLogger(__name__)

PLAN_VERSION = 7
PLAN_CHANGES: dict[int, str] = {
    1: "the first format",
    2: "the mesh is an object (num_nodes, per_node, two_level, first_rank) instead of [nodes, per_node]; "
       "an instruction without a source layout has src null instead of \"\"; layouts are checked against "
       "their grammar (R, P, Pmax, S<d>, A|B) when a plan is read; a plan may record its gradient buckets "
       "(gradient_sync: the bucket cap and the buckets; plans without them get buckets at the default cap)",
    3: "pipeline plans: `shape` (spmd or pipeline) says what `hetsynth run` executes; `pipeline` holds the "
       "stages (each with its SPMD plan per micro-batch size), boundaries with their resharding plans, "
       "micro-batches and the schedule's action lists; the SPMD fields stay the best SPMD plan",
    4: "a param instruction says how its training state is held (state: replicated or zero1, ZeRO stage 1) "
       "and a plan with zero1 parameters records state_shards (the state ratios, each one's rows per rank, "
       "the all-gather variant); a version-2 or -3 plan reads as a version-4 one with every state replicated",
    5: "fused collective-matmul instructions ag_matmul and matmul_rs (variants ring, sliced2, sliced4; issue 18); "
       "plans of versions 2 to 4 read unchanged",
    6: "training states zero2 (ZeRO stage 2: gradients reduce-scattered onto the state rows) and zero3 (stage 3: "
       "the parameter stored as rows, gathered at each use; its gradient sync is in no bucket), a gradient "
       "bucket has a kind (all_reduce, or reduce_scatter for zero2 parameters) and state_shards a scatter_variant; "
       "plans of versions 2 to 5 read unchanged",
    7: "the precision policy (precision: per device kind the compute dtype and loss scaling, master weights and "
       "gradient reduction in float32; instruction_set.mixed_precision); plans of versions 2 to 6 read as float32",
}


class PlanError(ValueError):
    """A plan file that cannot be used: wrong version, malformed, or for another model."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelInfo(_Frozen):
    ref: str
    fingerprint: str
    num_params: int
    batch_size: int
    dtype: str


# Copies of each trained parameter that training keeps (parameter, gradient, optimizer state),
# per optimizer the runtime offers; a plan's predicted state (DevicePrediction.state_gib)
# assumes AdamW (cost_models.memory).
STATE_COPIES = {"adamw": 4, "sgd": 2}
PLANNED_OPTIMIZER = "adamw"


class DevicePrediction(_Frozen):
    name: str
    kind: str
    ratio: float
    compute_s: float
    communication_s: float
    memory_gib: float
    memory_capacity_gib: float
    state_gib: float | None = Field(default=None, description="of memory_gib: parameters, gradients and "
                                    "optimizer state (None in plans written before the split was recorded)")
    saved_gib: float | None = Field(default=None, description="of memory_gib: tensors saved for backward")
    working_gib: float | None = Field(default=None, description="of memory_gib: transients, one op's unsaved inputs "
                                      "and output at once plus ZeRO-3's gathered parameter (planner.step_cost)")


class Prediction(_Frozen):
    step_time_s: float
    compute_s: float
    communication_s: float
    fits: bool
    devices: tuple[DevicePrediction, ...]


class BaselineResult(_Frozen):
    step_time_s: float
    sharding_ratios: tuple[float, ...]
    fits: bool
    max_memory_gib: float
    note: str = ""


class SynthesisStats(_Frozen):
    seconds: float
    search_seconds: float
    lp_seconds: float
    states_expanded: int
    rounds: int
    heuristic: str
    exact: bool = Field(description="no state was dropped by the search's width bound")


class PlanShape(StrEnum):
    SPMD = "spmd"
    PIPELINE = "pipeline"


class Plan(_Frozen):
    version: int = PLAN_VERSION
    model: ModelInfo
    cluster: ClusterSpec
    mesh: Mesh = Field(description="the mesh the layouts live on: nodes x devices per node when two-level "
                                   "layouts are used; 1 x devices when only one-level ones are")
    graph: ReferenceGraph
    sharding_ratios: tuple[float, ...]
    shards: ShardTable = Field(
        description="tensor -> layout -> split dim -> local length on each rank")
    instructions: tuple[Instruction, ...]
    predicted: Prediction
    baselines: dict[str, BaselineResult] = Field(default_factory=dict)
    synthesis: SynthesisStats
    gradient_sync: GradientSync | None = Field(
        default=None, description="gradient buckets (instruction_set.sync); None in plans written before "
                                  "they were recorded: the runtime then assigns them at the default cap")
    shape: PlanShape = Field(default=PlanShape.SPMD, description="what `hetsynth run` executes")
    pipeline: Pipeline | None = Field(default=None, description="the pipeline plan (instruction_set.pipeline)")

    state_shards: StateShards | None = Field(
        default=None, description="ZeRO-1/2/3 parameters' rows per rank (instruction_set.training_state); "
                                  "None when every parameter's state is replicated")
    precision: PrecisionPolicy | None = Field(
        default=None, description="what each device kind computes in (instruction_set.mixed_precision); None "
                                  "in plans written before it was recorded: float32 everywhere")

    @model_validator(mode="after")
    def _consistent(self) -> "Plan":
        if self.shape is PlanShape.PIPELINE and self.pipeline is None:
            raise ValueError("shape is pipeline but the plan holds no pipeline")
        if self.pipeline is not None and sum(self.pipeline.micro_batches) != self.model.batch_size:
            raise ValueError(f"micro-batches {list(self.pipeline.micro_batches)} add up to "
                             f"{sum(self.pipeline.micro_batches)}, the batch is {self.model.batch_size}")
        zero = {i.tensor: (self.graph.node(i.tensor).outputs[0].shape or (None,))[0]
                for i in self.instructions if i.kind == "param" and i.state != TrainingState.REPLICATED}
        if zero or self.state_shards is not None:
            check_state_shards(self.state_shards or StateShards(ratios=self.sharding_ratios, rows={}),
                               len(self.sharding_ratios), zero)
        check_states(self.graph, self.instructions)
        if self.pipeline is not None:
            staged = [k for k, stage in enumerate(self.pipeline.stages) for p in stage.plans.values()
                      if p.state_shards is not None]
            if staged:
                raise ValueError(f"pipeline stage(s) {sorted(set(staged))} shard training state (ZeRO): the pipeline "
                                 f"runtime keeps every stage's training state whole; plan the stages without ZeRO")
        if self.gradient_sync is not None:
            check_buckets(self.gradient_sync, self.instructions)
        if self.precision is not None:
            kinds = sorted({d.kind for d in self.cluster.devices})
            if sorted(self.precision.kinds) != kinds:
                raise ValueError(f"the precision policy covers device kinds {sorted(self.precision.kinds)}, "
                                 f"the cluster's devices are of kinds {kinds}")
        check_plan(PlanParts(ratios=self.sharding_ratios, mesh=self.mesh,
                             node_sizes=tuple(len(n.devices) for n in self.cluster.nodes), graph=self.graph,
                             shards=self.shards, instructions=self.instructions,
                             num_predicted=len(self.predicted.devices)))  # instruction_set.plan_checks
        return self

    def precision_policy(self) -> PrecisionPolicy:
        """The recorded policy, or float32 everywhere for a plan that records none."""
        return self.precision if self.precision is not None else choose_policy(self.cluster)

    def placed(self, layout: Layout) -> MeshLayout:
        """`layout` on the plan's mesh: which rank holds what."""
        return MeshLayout(self.mesh, layout)

    def buckets(self) -> tuple[GradBucket, ...]:
        """The gradient buckets: as recorded, or at the default cap for plans without them."""
        if self.gradient_sync is not None:
            return self.gradient_sync.buckets
        scatter = self.state_shards.scatter_variant if self.state_shards is not None else "padded"
        return assign_buckets(self.graph, self.instructions, self.shards, DEFAULT_BUCKET_CAP_BYTES,
                              scatter_variant=scatter)

    def lengths(self, tensor: str, layout: Layout) -> dict[int, tuple[int, ...]]:
        """{split dim: local length on each rank} of a tensor in a layout."""
        try:
            return self.shards[tensor][layout]
        except KeyError:
            raise PlanError(f"plan has no shard lengths for {tensor}:{layout}") from None


PipelineStage.model_rebuild(_types_namespace={"Plan": Plan})
Pipeline.model_rebuild(_types_namespace={"Plan": Plan})
Plan.model_rebuild()


def plan_text(plan: Plan) -> str:
    """The text of `plan`'s file."""
    return plan.model_dump_json(indent=1)


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write `plan` as JSON, whole or not at all (instruction_set.files: WriteError on failure)."""
    write_atomic(path, plan_text(plan))


def plan_from_json(raw: Any, source: str = "<plan>") -> Plan:
    if not isinstance(raw, dict) or "version" not in raw:
        raise PlanError(f"{source} is not a hetsynth plan (no 'version' field)")
    if raw["version"] == 1:
        raw = _from_version_1(raw)
        log.warning("%s is plan format version 1; read as version %d (%s)", source, PLAN_VERSION,
                    PLAN_CHANGES[2])
    if raw["version"] in (2, 3, 4, 5, 6):  # 3 pipelines, 4 training state, 5 fused kinds, 6 zero2, 7 precision
        raw = {**raw, "version": PLAN_VERSION}
    if raw["version"] != PLAN_VERSION:
        raise PlanError(
            f"{source} is plan format version {raw['version']!r}; this hetsynth reads versions 1 to "
            f"{PLAN_VERSION} (version {PLAN_VERSION}: {PLAN_CHANGES[PLAN_VERSION]}). Re-run `hetsynth plan` "
            f"to make a plan for this version."
        )
    try:
        return Plan.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        if not loc and first["type"] == "value_error":  # a consistency check (plan_checks)
            raise PlanError(f"{source} is inconsistent: {first['msg'].removeprefix('Value error, ')}; "
                            f"make the plan again with `hetsynth plan`") from None
        raise PlanError(f"{source} is malformed at {loc}: {first['msg']} "
                        f"({err.error_count()} error(s))") from None


def _from_version_1(raw: dict) -> dict:
    """A version-1 plan in version 2's form: the mesh [nodes, per_node] as an object (two-level
    when it has more than one node, as version 1 ran it), empty sources as null."""
    raw = copy.copy(raw)
    mesh = raw.get("mesh")
    if isinstance(mesh, (list, tuple)) and len(mesh) == 2 and all(isinstance(x, int) for x in mesh):
        raw["mesh"] = {"num_nodes": mesh[0], "per_node": mesh[1], "two_level": mesh[0] > 1, "first_rank": 0}
    if isinstance(raw.get("instructions"), list):
        raw["instructions"] = [{**i, "src": i["src"] or None} if isinstance(i, dict) and "src" in i else i
                               for i in raw["instructions"]]
    return {**raw, "version": 2}


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"plan file {str(path)!r} does not exist")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise PlanError(f"{path} is not JSON: {err}") from None
    except (OSError, UnicodeDecodeError) as err:  # unreadable for this user, or not text
        raise PlanError(f"plan file {path}: cannot read it: {err}") from None
    except RecursionError:
        raise PlanError(f"plan file {path}: nested too deeply to parse; make a new plan (hetsynth plan)") from None
    return plan_from_json(raw, str(path))
