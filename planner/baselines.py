"""Baselines under the same cost model as the synthesized plan.

- DP-EV: data parallelism with an even batch split; every parameter replicated, its
  gradient all-reduced (what PyTorch DDP does on any cluster).
- DP-CP: data parallelism with the batch split proportional to device throughput.
- Megatron: tensor parallelism inside each node and data parallelism across nodes
  (Shoeybi et al., 2019): the batch split evenly across nodes (`S0|R`), every weight of two
  or more dims split inside its node and replicated across nodes (`R|S<d>`, gradients
  all-reduced across nodes), no batch split inside a node; the search chooses the column /
  row splits. On a single node this is tensor parallelism over all its devices.

Every baseline is the synthesizer's own output on a restricted space (planner.problem
.Restrictions), so baselines and plans are costed by one code path; they also seed the
main search as incumbents (planner.planner).
"""

from __future__ import annotations

from typing import Sequence

from hetsynth.cost_models.memory import GIB
from hetsynth.instruction_set.cluster import ClusterSpec
from hetsynth.instruction_set.graph import ReferenceGraph
from hetsynth.instruction_set.layouts import R, Layout, Replicate, S, Shard
from hetsynth.instruction_set.mesh import Mesh
from hetsynth.instruction_set.plan import BaselineResult
from hetsynth.instruction_set.program import Instruction
from hetsynth.planner.problem import Problem, Restrictions, StorageClass
from hetsynth.planner.step_cost import predict_program
from hetsynth.planner.synthesis import synthesize

DP = Restrictions(param_layouts=frozenset({StorageClass.REPLICATED}), input_layout=S(0), two_level=False, allow_sfb=False,
                  batch_split_only=True)


def megatron_restrictions(cluster: ClusterSpec) -> Restrictions:
    two = Mesh.of([len(n.devices) for n in cluster.nodes]).two_level
    split = StorageClass.SHARDED_INSIDE if two else StorageClass.SHARDED
    return Restrictions(input_layout=Layout(Shard(0), Replicate()) if two else R,
                        param_layouts=frozenset({StorageClass.REPLICATED, split}),
                        shard_params_with_dims=2, no_batch_split_inside=True, allow_sfb=False)


def proportional(cluster: ClusterSpec) -> tuple[float, ...]:
    t = cluster.throughputs_flops()
    return tuple(x / sum(t) for x in t)


def even(cluster: ClusterSpec) -> tuple[float, ...]:
    return (1.0 / cluster.num_devices,) * cluster.num_devices


def restricted_program(graph: ReferenceGraph, cluster: ClusterSpec, ratios: Sequence[float],
                       restrictions: Restrictions, *, width: int,
                       memory_weight: float = 0.0) -> tuple[Instruction, ...] | None:
    result = synthesize(Problem(graph, cluster, ratios, restrictions, memory_weight),
                        width=width, progress=False)
    return result.instructions if result is not None else None


def baseline(graph: ReferenceGraph, cluster: ClusterSpec, ratios: Sequence[float],
             restrictions: Restrictions, *, width: int) -> BaselineResult:
    program = restricted_program(graph, cluster, ratios, restrictions, width=width)
    if program is None:
        return BaselineResult(step_time_s=float("inf"), sharding_ratios=tuple(ratios), fits=False,
                              max_memory_gib=0.0, note="no program in this space")
    pb = Problem(graph, cluster, ratios, restrictions)
    prediction, _ = predict_program(pb, program)  # gradient sync overlapped, as the runtime runs it
    return BaselineResult(step_time_s=prediction.step_time_s, sharding_ratios=tuple(ratios),
                          fits=prediction.fits,
                          max_memory_gib=max(d.memory_gib for d in prediction.devices))


def all_baselines(graph: ReferenceGraph, cluster: ClusterSpec, *, width: int) -> dict[str, BaselineResult]:
    """DP-EV, DP-CP and Megatron; one baseline whose space and ratios equal another's (DP-CP
    on a cluster of equal throughputs is DP-EV) is costed once."""
    spaces = {"dp_ev": (even(cluster), DP), "dp_cp": (proportional(cluster), DP),
              "megatron": (even(cluster), megatron_restrictions(cluster))}
    done: dict[tuple, BaselineResult] = {}
    out = {}
    for name, (ratios, restrictions) in spaces.items():
        key = (ratios, repr(restrictions))
        if key not in done:
            done[key] = baseline(graph, cluster, ratios, restrictions, width=width)
        out[name] = done[key]
    return out


__all__ = ["DP", "GIB", "all_baselines", "baseline", "even", "megatron_restrictions", "proportional",
           "restricted_program"]
