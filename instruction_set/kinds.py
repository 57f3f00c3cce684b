"""Instruction kinds: what sort of work an instruction of the distributed program is.

`Category` is shared by the instruction set, the cost model (a cost term's forms carry one,
cost_models.terms) and the runtime:

  storage        a graph input placed in its storage layout (param, input, buffer)
  compute        an op on local shards
  communication  a collective (later point-to-point) along a mesh axis
  local          a layout change without communication (slice, partial)
  fused          communication and compute in one instruction (sfb; later ag_matmul, matmul_rs)
"""

from __future__ import annotations

from enum import StrEnum


class Category(StrEnum):
    STORAGE = "storage"
    COMPUTE = "compute"
    COMMUNICATION = "communication"
    LOCAL = "local"
    FUSED = "fused"
