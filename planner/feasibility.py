"""Quick checks that reject a hopeless planning problem before any search.

The memory model (cost_models.memory) stores OPTIMIZER_COPIES copies of every parameter
(parameter, gradient, two Adam moments) on each device in proportion to its share: a
sharded parameter's shares sum to 1 over the devices, a replicated one is held whole by
every device, and activations only add to that. Summed over the devices, any plan therefore
needs at least

    sum_p OPTIMIZER_COPIES * bytes_p   <=   sum_i capacity_i

(the training state stored exactly once, spread perfectly). When this fails no program and
no ratios can fit and the search (which would otherwise try MEMORY_ATTEMPTS penalised
searches, minutes on a large model) is skipped. `check_memory_lower_bound` adds the tensors
saved for backward that no technique of the planner removes, each held at least once over all
devices (split, at best):

    sum_p K bytes_p + sum_{ops o outside blocks} saved_o + sum_{blocks b} min(saved_b, kept_b)
        <=  sum_i capacity_i

where saved_b is everything block b's ops save and kept_b the bytes of the values it reads
from before it (what it keeps when recomputed; instruction_set.blocks); ZeRO-1 and split
layouts store the state once at best, so K stays. The checks are sound, not complete: a
problem that passes may still not fit (replicated layers, one device's share), which the search
reports with the device that is short and what it tried (planner.planner).
"""

from __future__ import annotations

from hetsynth.cost_models.memory import GIB, OPTIMIZER_COPIES
from hetsynth.instruction_set.blocks import block_of
from hetsynth.instruction_set.cluster import ClusterSpec
from hetsynth.instruction_set.graph import Node, ReferenceGraph


def gib(x: float) -> str:
    """GiB as text: two decimals, or three significant digits below 0.01 GiB."""
    return f"{x:.2f}" if abs(x) >= 0.01 or x == 0 else f"{x:.3g}"


class PlanInfeasible(ValueError):
    """No plan fits the cluster's memory."""


def check_training_state_fits(graph: ReferenceGraph, cluster: ClusterSpec) -> None:
    """Raise PlanInfeasible when the parameters with their gradients and optimizer state
    alone exceed the memory of all the cluster's devices together."""
    state_bytes = OPTIMIZER_COPIES * sum(n.out.nbytes for n in graph.params)
    total_gib = sum(cluster.memories_gib())
    need_gib = state_bytes / GIB
    if need_gib > total_gib:
        raise PlanInfeasible(
            f"no plan fits in memory: the parameters, gradients and optimizer state of "
            f"{graph.model_ref or 'the model'} alone need {need_gib:.2f} GiB ({graph.num_params:,} parameters "
            f"x {OPTIMIZER_COPIES} copies: parameter, gradient, 2 Adam moments) and the "
            f"{cluster.num_devices} devices of {cluster.name!r} hold {total_gib:g} GiB in all, short by "
            f"{need_gib - total_gib:.2f} GiB before any activation; use more or larger devices or a "
            f"smaller model")


def _block_bytes(graph: ReferenceGraph) -> tuple[float, dict[str, tuple[float, float]]]:
    """Saved bytes of the ops outside any block; per block, (saved, kept inputs)."""
    outside, blocks, kept = 0.0, {}, {}
    owner = {n.name: block_of(n) for n in graph.calls}
    for node in graph.calls:
        saved = float(sum(t.nbytes for t in node.saved or ()))
        b = owner[node.name]
        if b is None:
            outside += saved
            continue
        blocks[b] = blocks.get(b, 0.0) + saved
        for t in node.inputs:
            source: Node = graph.node(t)
            if owner.get(t) != b and source.op not in ("param", "buffer") and source.outputs:
                kept.setdefault(b, {})[t] = float(source.outputs[0].nbytes)
    return outside, {b: (saved, sum(kept.get(b, {}).values())) for b, saved in blocks.items()}


def check_memory_lower_bound(graph: ReferenceGraph, cluster: ClusterSpec) -> None:
    """Raise PlanInfeasible when the training state and the saved tensors no technique removes
    exceed the memory of all devices together (module docstring), before any search."""
    check_training_state_fits(graph, cluster)
    state_gib = OPTIMIZER_COPIES * sum(n.out.nbytes for n in graph.params) / GIB
    outside, blocks = _block_bytes(graph)
    kept_gib = (outside + sum(min(saved, kept) for saved, kept in blocks.values())) / GIB
    total_gib = sum(cluster.memories_gib())
    if state_gib + kept_gib > total_gib:
        caps = cluster.memories_gib()
        largest = max(range(cluster.num_devices), key=lambda r: caps[r])
        raise PlanInfeasible(
            f"no plan fits in memory: even with the optimizer state sharded (ZeRO-1), all {len(blocks)} blocks "
            f"recomputed and every tensor split over all {cluster.num_devices} devices, the training state "
            f"({gib(state_gib)} GiB) and the tensors saved for backward that remain ({gib(kept_gib)} GiB) need "
            f"{gib(state_gib + kept_gib)} GiB, and the devices of {cluster.name!r} hold {total_gib:g} GiB in all "
            f"(the largest, {cluster.devices[largest].name!r}, {caps[largest]:g} GiB): short by "
            f"{gib(state_gib + kept_gib - total_gib)} GiB; use more devices or devices with more "
            f"memory, a smaller batch or a smaller model")
