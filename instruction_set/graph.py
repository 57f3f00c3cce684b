"""The reference graph: the single-device program that every plan distributes.

A `ReferenceGraph` is the captured forward pass of a model as ATen ops (torch.export,
training IR), in a topological order, as plain data:

- `Node.op` is `param`, `buffer` or `input` for graph inputs and `call` for ops; the graph's
  single output is the scalar loss named by `ReferenceGraph.loss`. A tensor the forward makes
  from Python values (`x[..., [-2]]`) is a `buffer` whose `value` holds its elements.
- `Node.target` is the ATen overload (`aten.linear.default`) or `getitem` (an element of a
  multi-output op such as `aten.split.Tensor`).
- `Node.args` / `kwargs` are JSON-encoded (instruction_set.args); `Node.inputs` lists the
  tensor-valued arguments the op reads, in argument order (a tensor passed twice appears
  twice); a rule gives one layout per entry.
- `Node.outputs` holds one TensorMeta per output (several for split/topk).
- FLOPs are per op, forward and backward, counted by FlopCounterMode on meta tensors;
  optionally each op's measured seconds on a reference machine (profiling.op_profile).
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
}


class TensorMeta(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)

    @property
    def is_float(self) -> bool:
        return self.dtype.startswith(("float", "bfloat", "complex"))


class SavedTensor(BaseModel):
    """A tensor an op saves for its backward pass (cost_models.saved_tensors): one of its inputs or
    outputs (by index), or a buffer of its own (`internal`: a mask, a softmax's logsumexp)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: Literal["input", "output", "internal"]
    index: int = 0
    nbytes: int


class Node(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    op: Literal["param", "buffer", "input", "call"]
    target: str = ""
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = Field(default_factory=dict)
    inputs: tuple[str, ...] = ()
    outputs: tuple[TensorMeta, ...] = ()
    multi_output: bool = False
    flops_fwd: float = 0.0
    flops_bwd: float = 0.0
    module_path: str = ""
    source: str = ""
    fqn: str = ""
    value: Any = None  # a constant's elements (nested lists of numbers), for buffer nodes without fqn
    fallback: bool = False
    measured_s: float | None = None  # forward + backward on the reference device (op profile)
    # what the op saves for backward, each storage counted at its first saver (None: not probed)
    saved: tuple[SavedTensor, ...] | None = None

    @property
    def out(self) -> TensorMeta:
        """The output of a single-output node."""
        assert len(self.outputs) == 1, f"{self.name} has {len(self.outputs)} outputs"
        return self.outputs[0]

    @property
    def out_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)


# what a torch.autograd.Function in the model means for training (ReferenceGraph.custom_backwards)
CUSTOM_BACKWARD = ("hetsynth differentiates their forward ops and never runs their backward: where a backward is "
                   "not its forward's derivative, the gradients differ from one device's")


class ReferenceGraph(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model_ref: str
    nodes: tuple[Node, ...]
    loss: str
    fallback_ops: tuple[str, ...] = ()
    reference_flops: float | None = None  # matmul FLOP/s of the machine that measured the ops
    update_s: tuple[float, float] | None = None  # optimizer step there: (s per parameter, s per byte)
    # per device kind: how many times longer the model takes there than on that machine
    # (timed on the devices, profiling.model_timing); replaces the matmul-rate ratio
    device_scales: dict[str, float] | None = None
    # bytes a gradient carries in its reduction per byte of the parameter (the plan's precision
    # policy: 0.5 where gradients are reduced in bfloat16; cost_models.precision.costed_graph)
    grad_reduce_scale: float = 1.0
    # per routed-experts node: each expert's expected share of the (token, expert) pairs, as the
    # user gave them (instruction_set.experts_op.with_expert_loads); absent: uniform routing
    expert_loads: dict[str, tuple[float, ...]] = Field(default_factory=dict)
    # torch.autograd.Function subclasses the forward applies: captured through their forward,
    # their own backward never runs (planner.capture)
    custom_backwards: tuple[str, ...] = ()

    def model_copy(self, *, update: dict | None = None, deep: bool = False) -> "ReferenceGraph":
        """A copy with fields replaced; the cached lookups (by_name, consumers, fingerprint)
        are dropped so that they describe the new nodes, not the old ones."""
        new = super().model_copy(update=update, deep=deep)
        for name, attr in vars(type(self)).items():
            if isinstance(attr, cached_property):
                new.__dict__.pop(name, None)
        return new

    @cached_property
    def by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    def node(self, name: str) -> Node:
        return self.by_name[name]

    @cached_property
    def consumers(self) -> dict[str, tuple[str, ...]]:
        users: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                users[i].append(n.name)
        return {k: tuple(v) for k, v in users.items()}

    @cached_property
    def fingerprint(self) -> str:
        """Hash of the graph structure (ops, arguments, shapes), independent of the model ref."""
        payload = json.dumps(
            [n.model_dump(mode="json", exclude={"source", "flops_fwd", "flops_bwd", "measured_s", "saved"})
             for n in self.nodes],
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    @property
    def params(self) -> list[Node]:
        return [n for n in self.nodes if n.op == "param"]

    @property
    def calls(self) -> list[Node]:
        return [n for n in self.nodes if n.op == "call"]

    @property
    def num_params(self) -> int:
        return sum(n.out.numel for n in self.params)

    @property
    def flops(self) -> tuple[float, float]:
        """(forward, backward) FLOPs of one training step."""
        return sum(n.flops_fwd for n in self.nodes), sum(n.flops_bwd for n in self.nodes)
