"""How a trained parameter's training state is held: whole on every replica, or sharded in rows.

    REPLICATED  parameter, gradient and optimizer state whole on every device that holds the
                parameter (the gradient all-reduced: data parallelism)
    ZERO1       optimizer state sharded in rows of dim 0 over all devices (Rajbhandari et al.,
                ZeRO, SC'20, stage 1): the gradient is all-reduced as for REPLICATED, each
                device updates only its rows (an optimizer over a view of them), and an
                all-gather after the step brings every device the updated parameter
    ZERO2       the gradient sharded too (stage 2): the gradient is reduce-scattered onto each
                device's rows (a gradient bucket of kind reduce_scatter, instruction_set.sync),
                so a device holds the whole gradient only until its bucket is copied in; each
                device updates its rows, and the same post-step all-gather follows
    ZERO3       the parameter sharded too (stage 3, FSDP): a device stores only its rows of the
                parameter; the whole parameter is all-gathered at each op that uses it and
                released after, gathered again in the backward, and its gradient is
                reduce-scattered onto the rows there (runtime.zero3); no post-step all-gather

A ZERO1, ZERO2 or ZERO3 parameter's rows per rank (`StateShards.rows`) come from the plan's state ratios q (one
per device, chosen from each device's free memory and speed, planner.zero) by largest
remainder, once, in the plan; a rank may hold zero rows. Rows of dim 0, not flat ranges:
a rank's rows are contiguous in the parameter, so its optimizer's shard is a view of the
module's parameter, and a checkpoint reassembles whole tensors by rows.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict

from hetsynth.instruction_set.kinds import kind as instruction_kind
from hetsynth.instruction_set.shards import largest_remainder


class TrainingState(StrEnum):
    REPLICATED = "replicated"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"


SHARDED_STATES = frozenset({TrainingState.ZERO1, TrainingState.ZERO2, TrainingState.ZERO3})
GATHERED_AFTER_STEP = frozenset({TrainingState.ZERO1, TrainingState.ZERO2})  # whole parameters, rows updated
# the gradient reduce-scatter variants the bucketed gradient sync issues asynchronously
# (runtime.grad_sync: ring's chain of point-to-point steps is not among them)
SCATTER_VARIANTS = ("padded", "grouped")


class StateShards(BaseModel):
    """The state ratios q (per device) and every ZERO1/2/3 parameter's rows per rank."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ratios: tuple[float, ...]
    rows: dict[str, tuple[int, ...]]
    variant: str = "padded"  # of the post-step all-gather of the rows, and ZERO3's gathers (all_gather's)
    scatter_variant: str = "padded"  # of the ZERO2/3 gradients' reduce-scatter (SCATTER_VARIANTS)

    def offset(self, tensor: str, rank: int) -> int:
        return sum(self.rows[tensor][:rank])


def state_rows(ratios: Sequence[float], dim0: int) -> tuple[int, ...]:
    """Rows of a parameter of `dim0` rows per device at state ratios `ratios`."""
    return tuple(largest_remainder(ratios, dim0))


def check_state_shards(shards: StateShards, num_devices: int, dims0: dict[str, int | None]) -> None:
    """Raise ValueError unless every ZERO1/2/3 parameter (`dims0`: its dim 0, None if scalar) has
    rows for every device summing to its dim 0, and no other tensor has rows."""
    if shards.variant not in instruction_kind("all_gather").variants:
        raise ValueError(f"state_shards.variant {shards.variant!r}: use one of "
                         f"{list(instruction_kind('all_gather').variants)}")
    if shards.scatter_variant not in SCATTER_VARIANTS:
        raise ValueError(f"state_shards.scatter_variant {shards.scatter_variant!r}: use one of {list(SCATTER_VARIANTS)}")
    if len(shards.ratios) != num_devices:
        raise ValueError(f"state_shards.ratios has {len(shards.ratios)} entries for {num_devices} devices")
    extra = sorted(set(shards.rows) - set(dims0))
    if extra:
        raise ValueError(f"state_shards has rows for {extra[:3]}, which are no zero1, zero2 or zero3 parameters")
    for tensor, dim0 in dims0.items():
        rows = shards.rows.get(tensor)
        if dim0 is None:
            raise ValueError(f"sharded-state parameter {tensor} has no dim 0 to shard in rows")
        if rows is None or len(rows) != num_devices or sum(rows) != dim0 or min(rows) < 0:
            raise ValueError(f"sharded-state parameter {tensor} (dim 0 of {dim0}) has rows {rows}; need "
                             f"{num_devices} lengths >= 0 summing to {dim0}")


def check_states(graph: Any, program: Sequence[Any]) -> None:
    """Raise ValueError unless every sharded-state parameter is stored replicated (R) and every
    ZERO3 one is read by compute instructions only (its gather is emitted at each compute use;
    runtime.zero3): no conversion, SFB or fused collective-matmul of it."""
    for i in program:
        if i.kind == "param" and i.state != TrainingState.REPLICATED and str(i.layout) != "R":
            raise ValueError(f"parameter {i.tensor} is stored {i.layout} with training state {i.state}: ZeRO "
                             f"shards the state of replicated (R) parameters only")
    zero3 = {i.tensor for i in program if i.kind == "param" and i.state == TrainingState.ZERO3}
    for i in program:
        reads = set(graph.node(i.node).inputs) if i.runs_op else set()
        bad = zero3 & (({i.tensor} if i.kind not in ("param", "compute", "all_reduce") else set())
                       | (reads if i.kind != "compute" else set()))
        if bad:
            raise ValueError(f"zero3 parameter(s) {sorted(bad)} feed a {i.kind} instruction ({i.describe()}): a "
                             f"ZeRO-3 parameter must be read by plain compute instructions only")


__all__ = ["GATHERED_AFTER_STEP", "SCATTER_VARIANTS", "SHARDED_STATES", "StateShards", "TrainingState", "check_states", "check_state_shards", "state_rows"]
