"""Instructions of a distributed program (HAP's distributed instruction set).

Each instruction makes one tensor available in one layout on every rank. Its `kind` is an
entry of the registry of instruction kinds (instruction_set.kinds: pattern, adjoint,
variants, category); a plan naming an unregistered kind does not load. A compute instruction
runs the op of `node` on local shards, inputs in the layouts `inputs` (one per Node.inputs
entry), with the rule's local rewrite; sfb (backward of the linear `node`) rebuilds the full
gradient of the replicated weight `tensor` from all-gathered factors.

A fused instruction (CommFuse, runtime.collectives.fused) runs a linear `node` (output
`tensor` in `layout`, inputs in `inputs`, rewrite `local`) together with the collective
feeding or fed by it, along `axis`, with `variant` ring / sliced2 / sliced4:
  ag_matmul   its first input is held in `src` (S(d)) and all-gathered to `inputs[0]` (R)
              chunk by chunk under the matmul; the gathered input is made available too
  matmul_rs   the rule's output `src` (P) is reduce-scattered to `layout` (S(d)) chunk by
              chunk; a `once:` bias is added after the scatter

Gradient synchronisation of a replicated parameter is an `all_reduce` with
`phase == "backward"` on the parameter (gradients are all-reduced in buckets of 25 MiB,
with the ring or hierarchical algorithm named by the variant). `axis` is the mesh axis a collective runs along (instruction_set.mesh): "all"
devices, "inner" (the devices of each node) or "outer" (one device per node, for every
local index). Layouts (`layout`, `src`, `inputs`) are instruction_set.layouts values, written
as their text in the plan's JSON. Forward collectives carry their adjoint in the
backward pass; `predicted_s` includes both. `alternatives` maps each implementation variant
the planner considered to its predicted seconds.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from hetsynth.instruction_set.kinds import Category, Phase, known_kind, kinds
from hetsynth.instruction_set.kinds import kind as instruction_kind
from hetsynth.instruction_set.layouts import LayoutField
from hetsynth.instruction_set.mesh import MeshAxis
from hetsynth.instruction_set.training_state import TrainingState

Kind = Annotated[str, AfterValidator(known_kind)]  # a registered kind (instruction_set.kinds)

COLLECTIVES = tuple(k.name for k in kinds(Category.COMMUNICATION))
FUSED_MATMULS = ("ag_matmul", "matmul_rs")  # a linear fused with the collective feeding it / fed by it

GRAD_BUCKET_BYTES = 25 * 2**20  # gradient all-reduce bucket (DDP's default bucket_cap_mb): cost and runtime


class Instruction(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Kind
    tensor: str
    layout: LayoutField
    src: LayoutField | None = None  # the layout a layout change reads
    node: str = ""
    inputs: tuple[LayoutField, ...] = ()
    local: str = ""
    variant: str = ""
    phase: Phase = Phase.FORWARD
    axis: MeshAxis = MeshAxis.ALL
    predicted_s: float = 0.0
    alternatives: dict[str, float] = Field(default_factory=dict)
    recompute: str = ""  # the recomputed block this instruction runs in (instruction_set.blocks), if any
    state: TrainingState = TrainingState.REPLICATED  # param: how its training state is held (training_state)

    @property
    def runs_op(self) -> bool:
        """Whether the instruction runs the op of `node` on inputs in `inputs` (compute, and a
        linear fused with its collective)."""
        return self.kind == "compute" or self.kind in FUSED_MATMULS

    def src_tensor(self, node_inputs: tuple[str, ...] | list[str]) -> str:
        """The tensor `src` is a layout of: the gathered input for ag_matmul (`node_inputs`:
        the inputs of `node`), else `tensor`."""
        return node_inputs[0] if self.kind == "ag_matmul" else self.tensor

    def describe(self) -> str:
        category = instruction_kind(self.kind).category
        if self.kind in FUSED_MATMULS:
            axis = f" over {self.axis} axis" if self.axis != "all" else ""
            return (f"{self.tensor}:{self.layout} = {self.kind}[{self.variant}] {self.node}"
                    f"({', '.join(map(str, self.inputs))}) from {self.src}{axis}")
        if category is Category.COMPUTE:
            return f"{self.tensor}:{self.layout} = {self.node}({', '.join(map(str, self.inputs))})"
        if category is Category.STORAGE:
            state = f" [{self.state}]" if self.state != TrainingState.REPLICATED else ""
            return f"{self.kind} {self.tensor}:{self.layout}{state}"
        arrow = f"{self.src}->{self.layout}" if self.src is not None else self.layout
        variant = f" [{self.variant}]" if self.variant and self.variant != "local" else ""
        phase = " (backward)" if self.phase == "backward" else ""
        axis = f" over {self.axis} axis" if self.axis != "all" else ""
        return f"{self.kind} {self.tensor} {arrow}{variant}{axis}{phase}"
