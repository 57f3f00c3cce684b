"""Quick checks that reject a hopeless planning problem before any search.

The memory model (cost_models.memory) stores OPTIMIZER_COPIES copies of every parameter
(parameter, gradient, two Adam moments) on each device in proportion to its share: a
sharded parameter's shares sum to 1 over the devices, a replicated one is held whole by
every device, and activations only add to that. Summed over the devices, any plan therefore
needs at least

    sum_p OPTIMIZER_COPIES * bytes_p   <=   sum_i capacity_i

(the training state stored exactly once, spread perfectly). When this fails no program and
no ratios can fit and the search (which would otherwise try MEMORY_ATTEMPTS penalised
searches, minutes on a large model) is skipped. The check is sound, not complete: a problem
that passes may still not fit (activations, replicated layers), which the search reports
with the device that is short (planner.planner).
"""

from __future__ import annotations

from cost_models.memory import GIB, OPTIMIZER_COPIES
from instruction_set.cluster import ClusterSpec
from instruction_set.graph import ReferenceGraph


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
