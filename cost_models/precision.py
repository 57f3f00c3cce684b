"""The cluster and the graph as a plan's precision policy makes them cost (mixed precision).

Under a policy (instruction_set.mixed_precision) the planner costs the same program on two
views of its problem:

- the cluster with each kind's matmul rate that of its compute dtype,

      throughput_i = rate_{kind(i)}(compute_dtype(kind(i)))      (FLOP/s, MatmulRates)

  so the sharding-ratio LP, whose work terms are flops / throughput_i, gives each device
  its share by its 16-bit rate (an A100 : T4 split follows 312 : 65, not 19.5 : 8.1);
- the graph as a rank computes it under autocast (where every kind computes in one 16-bit
  type): the graph runs once more on fake tensors under torch.autocast of that type
  (cost_models.saved_tensors.probe), and each op's outputs and saved tensors take the dtypes
  autocast gives them: matmuls and convolutions compute in 16 bits and save 16-bit copies
  of their inputs (a weight's copy is 2 bytes a parameter beside its float32 master, alive
  until the backward that uses it), ops autocast keeps in float32 (softmax, norms, losses)
  output and save float32, the rest follow their inputs. Activation memory, the bytes an op
  moves and the collectives on activations count those widths. Parameters, the graph's
  inputs and buffers keep their dtype: the master weights, their gradients (reduced in
  float32: the gradient all-reduce moves 4 bytes an element) and the optimizer state are
  float32, so the training state is 16 bytes a parameter as before. Where the kinds compute
  in different types (activations travel in float32 between them), or an op cannot run on
  fake tensors, every floating-point activation counts at the policy's activation dtype.

Measured op times (profiling.op_profile) scale with the compute dtype's rate like the roofline.
The policy float32 everywhere leaves both views unchanged (the same objects).
"""

from __future__ import annotations

import logging

from hetsynth.instruction_set.cluster import ClusterSpec, DeviceKind
from hetsynth.instruction_set.graph import DTYPE_BYTES, Node, ReferenceGraph, SavedTensor, TensorMeta
from hetsynth.instruction_set.mixed_precision import PrecisionPolicy
from hetsynth.cost_models.saved_tensors import probe

log = logging.getLogger(__name__)

_TORCH_NAMES = {"float32": "float32", "tf32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                "float8": "float8_e4m3fn"}


def costed_kind(kind: DeviceKind, name: str, policy: PrecisionPolicy) -> DeviceKind:
    """`kind` with its throughput_flops the rate of its compute dtype under `policy` (a costing
    view: the rate table, which no longer applies to it, dropped)."""
    dtype = policy.of(name).compute_dtype
    rate = kind.rate_flops(dtype)
    if rate is None:
        raise ValueError(f"device kind {name!r} has no {dtype.value} matmul rate; the policy cannot compute in it")
    if rate == kind.throughput_flops:
        return kind
    return kind.model_copy(update={"throughput_flops": rate, "matmul_flops": None})


def costed_cluster(cluster: ClusterSpec, policy: PrecisionPolicy) -> ClusterSpec:
    """The cluster whose kinds' throughput_flops are their compute dtypes' rates."""
    if not policy.is_mixed:
        return cluster
    kinds = {name: costed_kind(k, name, policy) if name in policy.kinds else k
             for name, k in cluster.device_kinds.items()}
    return cluster.model_copy(update={"device_kinds": kinds})


def _meta(meta: TensorMeta, dtype: str) -> TensorMeta:
    return meta.model_copy(update={"dtype": dtype}) if meta.is_float and meta.dtype != dtype else meta


def _saved(saved: SavedTensor, source: TensorMeta | None, dtype: str) -> SavedTensor:
    """A saved activation at `dtype`'s width (internal buffers and non-float tensors kept)."""
    if source is None or not source.is_float:
        return saved
    width = DTYPE_BYTES.get(source.dtype, 4)
    return saved.model_copy(update={"nbytes": saved.nbytes * DTYPE_BYTES[dtype] // width})


def _node(node: Node, graph: ReferenceGraph, dtype: str) -> Node:
    if node.op != "call":
        return node
    update: dict = {"outputs": tuple(_meta(m, dtype) for m in node.outputs)}
    if node.saved is not None:
        update["saved"] = tuple(_saved(s, _source(node, s, graph), dtype) for s in node.saved)
    return node.model_copy(update=update)


def _source(node: Node, saved: SavedTensor, graph: ReferenceGraph) -> TensorMeta | None:
    """The activation a saved tensor is (None for an op's own buffers and for parameters)."""
    if saved.source == "output" and saved.index < len(node.outputs):
        return node.outputs[saved.index]
    if saved.source == "input" and saved.index < len(node.inputs):
        producer = graph.node(node.inputs[saved.index])
        return producer.outputs[0] if producer.op in ("call", "input") and producer.outputs else None
    return None


def costed_graph(graph: ReferenceGraph, policy: PrecisionPolicy) -> ReferenceGraph:
    """The graph as a rank computes it under `policy`: where every kind computes in one 16-bit
    type, with each op's output dtypes and saved tensors as a fake run under autocast of that
    type finds them (cost_models.saved_tensors.probe); else (float32 activations between kinds
    of different types, or an op fake tensors cannot run) every floating-point activation in
    the policy's activation dtype."""
    if policy.reduce_scale != graph.grad_reduce_scale:
        graph = graph.model_copy(update={"grad_reduce_scale": policy.reduce_scale})
    if not policy.is_mixed:
        return graph
    dtype = _TORCH_NAMES[policy.activation_dtype.value]
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"activations in {policy.activation_dtype.value}: no byte width known for {dtype}")
    if dtype != "float32" and all(n.saved is not None for n in graph.calls):
        found = _probed_once(graph, dtype)
        if found is not None:
            return found
    return graph.model_copy(update={"nodes": tuple(_node(n, graph, dtype) for n in graph.nodes)})


_PROBED: list[tuple[ReferenceGraph, str, ReferenceGraph | None]] = []  # the last few, newest last


def _probed_once(graph: ReferenceGraph, dtype: str) -> ReferenceGraph | None:
    """_probed, once per graph object and dtype among the last four: planning costs the same
    graph several times (the search, the evaluation of its plan, the memory checks)."""
    for seen, seen_dtype, found in _PROBED:
        if seen is graph and seen_dtype == dtype:
            return found
    found = _probed(graph, dtype)
    _PROBED[:] = [*_PROBED[-3:], (graph, dtype, found)]
    return found


def _probed(graph: ReferenceGraph, dtype: str) -> ReferenceGraph | None:
    """The graph with the outputs' dtypes and the saved tensors of a fake run under autocast of
    `dtype`; None when an op cannot run on fake tensors under autocast."""
    import torch

    try:
        found = probe(graph, autocast=getattr(torch, dtype))
    except Exception as err:  # any op's fake kernel may raise anything; the uniform rewrite still holds
        log.warning("could not probe the graph under autocast of %s (%s: %s); every activation is "
                    "counted in %s", dtype, type(err).__name__, err, dtype)
        return None
    nodes = []
    for n in graph.nodes:
        if n.op == "call":
            dtypes = found.dtypes[n.name]
            outputs = n.outputs if len(dtypes) != len(n.outputs) else tuple(
                _meta(m, d) if d.startswith(("float", "bfloat")) else m for m, d in zip(n.outputs, dtypes))
            n = n.model_copy(update={"outputs": outputs, "saved": found.saved[n.name]})
        nodes.append(n)
    return graph.model_copy(update={"nodes": tuple(nodes)})


def costed(graph: ReferenceGraph, cluster: ClusterSpec, policy: PrecisionPolicy) -> tuple[ReferenceGraph, ClusterSpec]:
    """(graph, cluster) as the planner costs them under `policy`."""
    return costed_graph(graph, policy), costed_cluster(cluster, policy)
