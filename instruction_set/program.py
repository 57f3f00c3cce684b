"""Instructions of a distributed program (HAP's distributed instruction set).

Each instruction makes one tensor available in one layout on every rank:

  param / input / buffer   a graph input in its storage layout (a param's local slice, a
                           rank's rows of the batch)
  compute                  the op of `node` on local shards, inputs in the layouts `inputs`
                           (one per Node.inputs entry), with the rule's local rewrite
  all_gather      S(d) -> R      reduce_scatter  P -> S(d)     all_reduce  P -> R
  all_to_all      S(i) -> S(j)   slice           R -> S(d)     partial     R -> P
  all_reduce_max  Pmax -> R
  sfb             backward of the linear `node` rebuilds the full gradient of the replicated
                  weight `tensor` from all-gathered factors (sufficient-factor broadcasting)

Gradient synchronisation of a replicated parameter is an `all_reduce` with
`phase == "backward"` on the parameter (gradients are all-reduced in buckets of 25 MiB,
with the ring or hierarchical algorithm named by the variant). `axis` is the mesh axis a collective runs along (instruction_set.mesh): "all"
devices, "inner" (the devices of each node) or "outer" (one device per node, for every
local index). Forward collectives carry their adjoint in the
backward pass; `predicted_s` includes both. `alternatives` maps each implementation variant
the planner considered to its predicted seconds.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Kind = Literal[
    "param", "input", "buffer", "compute", "sfb", "all_gather", "reduce_scatter", "all_reduce",
    "all_reduce_max", "all_to_all", "slice", "partial",
]

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_reduce_max", "all_to_all")

GRAD_BUCKET_BYTES = 25 * 2**20  # gradient all-reduce bucket (DDP's default bucket_cap_mb): cost and runtime


class Instruction(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Kind
    tensor: str
    layout: str
    src: str = ""
    node: str = ""
    inputs: tuple[str, ...] = ()
    local: str = ""
    variant: str = ""
    phase: Literal["forward", "backward"] = "forward"
    axis: Literal["all", "inner", "outer"] = "all"
    predicted_s: float = 0.0
    alternatives: dict[str, float] = Field(default_factory=dict)

    def describe(self) -> str:
        if self.kind == "compute":
            return f"{self.tensor}:{self.layout} = {self.node}({', '.join(self.inputs)})"
        if self.kind in ("param", "input", "buffer"):
            return f"{self.kind} {self.tensor}:{self.layout}"
        arrow = f"{self.src}->{self.layout}" if self.src else self.layout
        variant = f" [{self.variant}]" if self.variant and self.variant != "local" else ""
        phase = " (backward)" if self.phase == "backward" else ""
        axis = f" over {self.axis} axis" if self.axis != "all" else ""
        return f"{self.kind} {self.tensor} {arrow}{variant}{axis}{phase}"
