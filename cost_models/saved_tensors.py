"""What each op of a reference graph saves for its backward pass, measured from torch.

The graph runs once more after capture, op by op, on FakeTensors on the CPU (no data, no
FLOPs) inside `torch.autograd.graph.saved_tensors_hooks`, so the bytes are autograd's own,
not a guess from the op's outputs: a linear saves its input, a ReLU its output, a layer norm
its input, mean and rstd, a CPU flash attention q, k, v, its output and logsumexp (the meta
device would run the math path, which saves the probability matrix: hence CPU fakes, the
kernels the CPU runtime runs; on GPUs the CPU choice is an upper bound for flash kernels).

Each saved tensor is counted once per storage over the whole step, at the first op that saves
it (views share their base's storage: a transpose saved by a matmul is its input); parameters
are state, not activations, and are skipped. A saved tensor's `source` says how it scales in a
distributed program: an input or an output of the op (with the layout the rule gives that
tensor), or `internal` (with the rule's share): cost_models.memory.activation_memory.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from hetsynth.instruction_set.graph import Node, ReferenceGraph, SavedTensor
from hetsynth.instruction_set.interpret import call_node, constant

log = logging.getLogger(__name__)

CPU = torch.device("cpu")


def _storage(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def _tensors(value: Any) -> list[torch.Tensor]:
    values = value if isinstance(value, (tuple, list)) else [value]
    return [v for v in values if isinstance(v, torch.Tensor)]


class _Recorder:
    """pack() attributes each new storage to the running node (module docstring)."""

    def __init__(self) -> None:
        self.seen: set[StorageWeakRef] = set()
        self.saved: list[tuple[torch.Tensor, StorageWeakRef]] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage(t)
        if key not in self.seen:
            self.seen.add(key)
            self.saved.append((t, key))
        return t

    def take(self) -> list[tuple[torch.Tensor, StorageWeakRef]]:
        out, self.saved = self.saved, []
        return out


def _saved(t: torch.Tensor, key: StorageWeakRef, inputs: list[Any], outputs: list[torch.Tensor]) -> SavedTensor:
    """What `t` (with storage `key`) is to the op that saved it: one of its inputs or outputs;
    under autocast also the copy autocast made of an input in another dtype (same shape), which
    scales as that input does; else an internal buffer."""
    nbytes = t.untyped_storage().nbytes()
    for kind, values in (("input", inputs), ("output", outputs)):
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor) and _storage(v) == key:
                return SavedTensor(source=kind, index=i, nbytes=nbytes)
    for i, v in enumerate(inputs):
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != t.dtype and v.shape == t.shape:
            return SavedTensor(source="input", index=i, nbytes=nbytes)
    return SavedTensor(source="internal", nbytes=nbytes)


def _leaf(node: Node, mode: FakeTensorMode) -> torch.Tensor:
    meta = node.out
    if node.value is not None:
        with mode:
            return constant(node, CPU)
    with mode:
        t = torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device=CPU)
    return t.requires_grad_(node.op == "param" and meta.is_float)


@dataclass(frozen=True)
class Probe:
    """What one fake run of a graph found: per call node the tensors it saves for backward
    and the dtypes of its tensor outputs."""

    saved: dict[str, tuple[SavedTensor, ...]]
    dtypes: dict[str, tuple[str, ...]]


def probe(graph: ReferenceGraph, autocast: torch.dtype | None = None) -> Probe:
    """Run the graph on FakeTensors (module docstring), under torch.autocast of `autocast` on
    the CPU when given: then matmuls and convolutions run in that type and save 16-bit copies
    of their inputs (parameters included: the copy is not the parameter), ops autocast keeps in
    float32 (softmax, norms, losses) run and save in float32, the rest in their inputs' type,
    as a rank of a plan with that precision policy computes (runtime.mixed_precision)."""
    mode, rec = FakeTensorMode(allow_non_fake_inputs=True), _Recorder()
    env: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op != "call":
            env[node.name] = _leaf(node, mode)
            if node.op == "param":
                rec.seen.add(_storage(env[node.name]))
    saved: dict[str, tuple[SavedTensor, ...]] = {}
    dtypes: dict[str, tuple[str, ...]] = {}
    amp = (torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext())
    with mode, amp, torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
        for node in graph.calls:
            env[node.name] = call_node(node, env, CPU)
            inputs, outputs = [env[name] for name in node.inputs], _tensors(env[node.name])
            saved[node.name] = tuple(_saved(t, key, inputs, outputs) for t, key in rec.take())
            dtypes[node.name] = tuple(str(t.dtype).removeprefix("torch.") for t in outputs)
    return Probe(saved, dtypes)


def probe_saved(graph: ReferenceGraph) -> dict[str, tuple[SavedTensor, ...]]:
    """Node name -> the tensors it saves for backward (parameters excluded, each storage once)."""
    return probe(graph).saved


def with_saved(graph: ReferenceGraph) -> ReferenceGraph:
    """The graph with every call node's `saved` filled in; unchanged (the memory model then
    bounds activations by op outputs) when an op cannot run on FakeTensors."""
    try:
        saved = probe_saved(graph)
    except Exception as err:  # any op's fake kernel may raise anything; the bound still holds
        log.warning("could not probe the tensors saved for backward (%s: %s); activation memory "
                    "is bounded by the ops' outputs instead", type(err).__name__, err)
        return graph
    nodes = tuple(n.model_copy(update={"saved": saved[n.name]}) if n.name in saved else n for n in graph.nodes)
    return graph.model_copy(update={"nodes": nodes})
