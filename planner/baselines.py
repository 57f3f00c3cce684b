"""Baselines under the same cost model as the synthesized plan.

- DP-EV: data parallelism with an even batch split; every parameter replicated, its
  gradient all-reduced (what PyTorch DDP does on any cluster).
- DP-CP: data parallelism with the batch split proportional to device throughput.
- Megatron: tensor parallelism inside each node (every weight of two or more dims sharded,
  activations replicated within the node, the search choosing column/row splits) and data
  parallelism across nodes, batch split evenly over nodes (Shoeybi et al., 2019). The node's
  program is synthesized on that node alone at its share of the batch; gradients of each
  device's parameter slices are then all-reduced across nodes, all of a node's devices
  sharing its NIC. Step time = slowest node + that all-reduce.

DP programs are the synthesizer's own output with restricted layouts (planner.problem
.Restrictions), so baselines and plans are costed by one code path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from cost_models.cluster import ClusterSpec
from cost_models.memory import GIB
from instruction_set.graph import ReferenceGraph
from instruction_set.layouts import R, S, is_shard
from instruction_set.plan import BaselineResult
from planner.evaluate import memory_bytes, predict, program_terms
from planner.problem import Problem, Restrictions
from planner.synthesis import synthesize

DP = Restrictions(param_layouts=(R,), input_layout=S(0), allow_sfb=False,
                  variants={"all_reduce": ("ring",)})
TP = Restrictions(input_layout=R, shard_params_with_dims=2, allow_sfb=False)


def proportional(cluster: ClusterSpec) -> tuple[float, ...]:
    t = cluster.throughputs_flops()
    return tuple(x / sum(t) for x in t)


def even(cluster: ClusterSpec) -> tuple[float, ...]:
    return (1.0 / cluster.num_devices,) * cluster.num_devices


def data_parallel(graph: ReferenceGraph, cluster: ClusterSpec, ratios: Sequence[float],
                  *, width: int) -> BaselineResult:
    pb = Problem(graph, cluster, ratios, DP)
    result = synthesize(pb, width=width, progress=False)
    prediction = predict(pb, program_terms(pb, result.instructions))
    return BaselineResult(step_time_s=prediction.step_time_s, sharding_ratios=tuple(ratios),
                          fits=prediction.fits,
                          max_memory_gib=max(d.memory_gib for d in prediction.devices))


@dataclass(frozen=True)
class _NodeTP:
    step_time_s: float
    local_param_bytes: float
    max_memory_gib: float
    fits: bool


def _node_tp(graph: ReferenceGraph, node_cluster: ClusterSpec, width: int) -> _NodeTP:
    pb = Problem(graph, node_cluster, even(node_cluster), TP)
    result = synthesize(pb, width=width, progress=False)
    terms = program_terms(pb, result.instructions)
    prediction = predict(pb, terms)
    local = sum(pb.meta(i.tensor).nbytes / (pb.n if is_shard(i.layout) else 1)
                for i in result.instructions if i.kind == "param")
    return _NodeTP(prediction.step_time_s, local * pb.n, max(memory_bytes(pb, terms)) / GIB,
                   prediction.fits)


def megatron(graph_for_batch: Callable[[int], ReferenceGraph], global_batch: int,
             cluster: ClusterSpec, *, width: int) -> BaselineResult:
    nodes = len(cluster.nodes)
    if global_batch < nodes:
        return BaselineResult(step_time_s=float("inf"), sharding_ratios=even(cluster), fits=False,
                              max_memory_gib=0.0, note=f"batch {global_batch} < {nodes} nodes")
    graph = graph_for_batch(global_batch // nodes)
    per_kind: dict[tuple[str, int], _NodeTP] = {}
    for i, node in enumerate(cluster.nodes):
        key = (next(d.kind for d in cluster.devices if d.name == node.devices[0]), len(node.devices))
        if key not in per_kind:
            per_kind[key] = _node_tp(graph, cluster.node_subcluster(i), width)
    slowest = max(per_kind.values(), key=lambda r: r.step_time_s)
    sync = _cross_node_allreduce(cluster, max(r.local_param_bytes for r in per_kind.values()))
    note = ("" if global_batch % nodes == 0 else
            f"{global_batch // nodes} samples per node ({global_batch} not divisible by {nodes} nodes)")
    return BaselineResult(step_time_s=slowest.step_time_s + sync, sharding_ratios=even(cluster),
                          fits=all(r.fits for r in per_kind.values()),
                          max_memory_gib=max(r.max_memory_gib for r in per_kind.values()), note=note)


def _cross_node_allreduce(cluster: ClusterSpec, node_bytes: float) -> float:
    """Ring all-reduce across nodes of every device's slices; a node's NIC carries them all."""
    nodes = len(cluster.nodes)
    if nodes == 1:
        return 0.0
    links = cluster.links
    nic = min(n.nic_bandwidth_gbps or links.inter_node_bandwidth_gbps for n in cluster.nodes)
    steps = 2 * (nodes - 1)
    return steps * links.inter_node_latency_us * 1e-6 + steps / nodes * node_bytes * 8 / (nic * 1e9)

