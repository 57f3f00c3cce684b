"""The Plan: everything a rank needs to run its part of training, as versioned JSON.

A plan holds the reference graph, the per-device sharding ratios, the per-tensor shard
lengths (derived once, instruction_set.shards), the distributed program, the predicted
step time and per-device compute / communication / memory, the same predictions for the
baselines, the gradient buckets (instruction_set.sync), and statistics of the synthesis. It contains no torch objects; the runtime
resolves it against real process groups.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from instruction_set.cluster import ClusterSpec
from instruction_set.graph import ReferenceGraph
from instruction_set.plan_checks import PlanParts, ShardTable, check_plan
from instruction_set.program import Instruction
from instruction_set.sync import GradientSync, check_buckets

PLAN_VERSION = 1


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


class DevicePrediction(_Frozen):
    name: str
    kind: str
    ratio: float
    compute_s: float
    communication_s: float
    memory_gib: float
    memory_capacity_gib: float


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


class Plan(_Frozen):
    version: int = PLAN_VERSION
    model: ModelInfo
    cluster: ClusterSpec
    mesh: tuple[int, int] = Field(description="(nodes, devices per node) of two-level layouts; "
                                               "(1, devices) when only one-level layouts are used")
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

    @model_validator(mode="after")
    def _consistent(self) -> "Plan":
        if self.gradient_sync is not None:
            check_buckets(self.gradient_sync, self.instructions)
        check_plan(PlanParts(ratios=self.sharding_ratios, mesh=self.mesh,
                             node_sizes=tuple(len(n.devices) for n in self.cluster.nodes), graph=self.graph,
                             shards=self.shards, instructions=self.instructions,
                             num_predicted=len(self.predicted.devices)))  # instruction_set.plan_checks
        return self

    def lengths(self, tensor: str, layout: str) -> dict[int, tuple[int, ...]]:
        """{split dim: local length on each rank} of a tensor in a layout."""
        try:
            return self.shards[tensor][layout]
        except KeyError:
            raise PlanError(f"plan has no shard lengths for {tensor}:{layout}") from None


def save_plan(plan: Plan, path: str | Path) -> None:
    Path(path).write_text(plan.model_dump_json(indent=1))


def plan_from_json(raw: Any, source: str = "<plan>") -> Plan:
    if not isinstance(raw, dict) or "version" not in raw:
        raise PlanError(f"{source} is not a hetsynth plan (no 'version' field)")
    if raw["version"] != PLAN_VERSION:
        raise PlanError(
            f"{source} is plan format version {raw['version']!r}; this hetsynth reads version "
            f"{PLAN_VERSION}. Re-run `hetsynth plan` to make a plan for this version."
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


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"plan file {str(path)!r} does not exist")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise PlanError(f"{path} is not JSON: {err}") from None
    return plan_from_json(raw, str(path))
