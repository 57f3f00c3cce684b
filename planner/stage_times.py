"""What the schedule simulation needs of a pipeline: each stage's forward and backward seconds
per micro-batch, its end-of-step phases, and each boundary transfer's seconds and NICs.

A stage's phases come from its SPMD plan's own cost terms at that micro-batch size
(planner.step_cost._split), not from the plan's whole-step prediction:

    F_s(b) = sum_i f_i(b)         the forward halves of the stage program at size b
    B_s(b) = sum_i beta_i(b)      its backward halves (the gradient all-reduces excluded)
    U_s    = sum_p u_p            its parameter updates, once per step
    Y_s    = sum_a AR_ring(sum_{p synchronised over axis a} bytes_p, a)

Y_s is the in-stage gradient synchronisation as runtime.pipeline runs it: after the last
backward, one synchronous all-reduce (gloo's, the `ring` variant of the cost model) per axis,
of all the replicated gradients the plan synchronises over that axis, coalesced; not the SPMD
plan's buckets overlapped with the backward. A parameter that several stages hold (GPT's tied embedding) is
then summed over all their ranks at its whole size (`shared_s`), and the clipping norm and the
loss take one world all-reduce of 16 bytes (`global_s`).

A boundary transfer (forward: the activation; backward: its gradient) takes its resharding
plan's predicted seconds and occupies the NICs its chains cross, (host, "out") at the sender
and (host, "in") at the receiver: transfers that share a NIC queue for it
(cost_models.schedule). What the transfer costs the CPU workers at both ends while it runs in
the background (the kinds' measured point-to-point share of its seconds plus their cost per
message times the slices, `p2p_cpu_share` and `p2p_cpu_us_per_message`, profiled apart from
the all-reduces' that planner.step_cost charges the gradient buckets; a spec profiled without
them falls back to those) is added to the sending action of that micro-batch (the forward
of the source stage, the backward of the destination stage), and the receiving end's is the
simulation's receive CPU (cost_models.schedule: paid only where the receiver is busy while
the data arrives):

    F_src(m) += X_src(m),  B_dst(m) += X_dst(m),  receive_cpu[(i, F)][m] = X_dst(m),
    receive_cpu[(i, B)][m] = X_src(m)

X_s(m) the transfer CPU of boundary i's slices at stage s's busiest worker (transfer_cpu_s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

from hetsynth.cost_models.comm import CommModel
from hetsynth.cost_models.schedule import StageTimes
from hetsynth.cost_models.terms import seconds
from hetsynth.instruction_set.cluster import ClusterSpec
from hetsynth.instruction_set.pipeline import Boundary, PipelineStage
from hetsynth.instruction_set.plan import Plan
from hetsynth.planner.problem import Problem, plan_problem
from hetsynth.planner.step_cost import _split

Channel = tuple[int, str]  # (boundary index, "F" | "B")


@dataclass(frozen=True)
class StagePhases:
    """One stage at one micro-batch size (module docstring)."""

    forward_s: float
    backward_s: float
    update_s: float
    sync_s: float


def stage_phases(plan: Plan) -> StagePhases:
    """F, B, U and Y of a stage plan (module docstring), on the plan's own sub-cluster."""
    pb = plan_problem(plan)
    forward, backward, post = _split(pb, list(plan.instructions))
    return StagePhases(forward_s=sum(seconds(t.time) for t in forward),
                       backward_s=sum(seconds(f) for f in backward if f is not None),
                       update_s=sum(seconds(t.time) for t in post), sync_s=_sync_s(pb, plan))


def _sync_s(pb: Problem, plan: Plan) -> float:
    """Y_s: one ring all-reduce per axis of all the gradients synchronised over it."""
    nbytes: dict[str, float] = {}
    for ins in plan.instructions:
        if ins.kind == "all_reduce" and ins.phase == "backward" and pb.comm.group_size(ins.axis) > 1:
            nbytes[ins.axis] = nbytes.get(ins.axis, 0.0) + pb.meta(ins.tensor).nbytes * pb.graph.grad_reduce_scale
    even = (1.0 / pb.width,) * pb.width
    return sum(pb.comm.cost("all_reduce", "ring", n, axis).at(even) for axis, n in nbytes.items())


def all_reduce_s(cluster: ClusterSpec, ranks: range, nbytes: float) -> float:
    """One ring all-reduce of `nbytes` over the ranks `ranks` (0 for a single rank)."""
    if len(ranks) < 2:
        return 0.0
    comm = CommModel(cluster.subset(ranks))
    return comm.cost("all_reduce", "ring", nbytes, "all").at((1.0 / comm.width,) * comm.width)


def shared_s(stages: Sequence[PipelineStage], cluster: ClusterSpec) -> float:
    """The whole-size all-reduces of the parameters several stages hold, over the span of
    their ranks (an upper bound when the holders are not adjacent stages)."""
    holders: dict[str, list[PipelineStage]] = {}
    nbytes: dict[str, int] = {}
    for st in stages:
        for node in next(iter(st.plans.values())).graph.params:
            holders.setdefault(node.fqn, []).append(st)
            nbytes[node.fqn] = node.out.nbytes
    total = 0.0
    for fqn, held in holders.items():
        if len(held) > 1:
            scale = next(iter(held[0].plans.values())).precision_policy().reduce_scale
            total += all_reduce_s(cluster, range(held[0].first_rank, held[-1].ranks.stop), float(nbytes[fqn]) * scale)
    return total


def global_s(cluster: ClusterSpec) -> float:
    """The world all-reduce of [norm^2, loss] (two float64)."""
    return all_reduce_s(cluster, range(cluster.num_devices), 16.0)


def nics(boundary: Boundary, b: int, hosts: Sequence[int], direction: str) -> frozenset[Hashable]:
    """The NICs a boundary's transfer at size b crosses: (host, "out") of every sender and
    (host, "in") of every receiver of a chain between two hosts (backward: reversed)."""
    out: set[Hashable] = set()
    for chain in boundary.reshard[b].chains:
        for a, c in zip(chain.members, chain.members[1:]):
            src, dst = (a, c) if direction == "F" else (c, a)
            if hosts[src] != hosts[dst]:
                out |= {(hosts[src], "out"), (hosts[dst], "in")}
    return frozenset(out)


def transfer_cpu_s(stage: PipelineStage, boundary: Boundary, b: int, transfer_s: float) -> float:
    """What one transfer at size b costs the busiest worker of `stage` at one of its ends:
    max over its ranks r of gamma_k(r) * seconds + m_k(r) * (slices r sends or receives)."""
    plan = stage.plans[b]
    slices = {r: sum(r in c.members for c in boundary.reshard[b].chains) for r in stage.ranks}
    costs = []
    for r, n in slices.items():
        kind = plan.cluster.device_kinds[plan.cluster.devices[r - stage.first_rank].kind]
        if n:
            share, per_message = kind.p2p_cpu()
            costs.append(share * transfer_s + per_message * 1e-6 * n)
    return max(costs, default=0.0)


def boundary_cpus(stages: Sequence[PipelineStage], boundaries: Sequence[Boundary],
                  sizes: Sequence[int]) -> list[tuple[tuple[float, ...], tuple[float, ...]]]:
    """Per boundary, (X_src(m), X_dst(m)) per micro-batch: what its transfer of micro-batch m
    costs its source and its destination stage (module docstring)."""
    out = []
    for bd in boundaries:
        ends = []
        for s in (bd.src_stage, bd.dst_stage):
            cpu = {b: transfer_cpu_s(stages[s], bd, b, bd.reshard[b].predicted_s) for b in set(sizes)}
            ends.append(tuple(cpu[b] for b in sizes))
        out.append((ends[0], ends[1]))
    return out


def stage_times(stages: Sequence[PipelineStage], boundaries: Sequence[Boundary], sizes: Sequence[int],
                cpus: Sequence[tuple[tuple[float, ...], tuple[float, ...]]] | None = None) -> list[StageTimes]:
    """Per stage, the forward and backward seconds of every micro-batch (the CPU of the
    transfers it sends included), the sync and the update (module docstring); `cpus`:
    boundary_cpus(stages, boundaries, sizes) when already known."""
    phases = [{b: stage_phases(st.plans[b]) for b in set(sizes)} for st in stages]
    fwd = [[phases[s][b].forward_s for b in sizes] for s in range(len(stages))]
    bwd = [[phases[s][b].backward_s for b in sizes] for s in range(len(stages))]
    cpus = boundary_cpus(stages, boundaries, sizes) if cpus is None else cpus
    for bd, (src, dst) in zip(boundaries, cpus):  # the source sends forward, the destination backward
        for m in range(len(sizes)):
            fwd[bd.src_stage][m] += src[m]
            bwd[bd.dst_stage][m] += dst[m]
    big = max(sizes)
    return [StageTimes(tuple(fwd[s]), tuple(bwd[s]), sync_s=phases[s][big].sync_s, update_s=phases[s][big].update_s)
            for s in range(len(stages))]


def receive_cpu(cpus: Sequence[tuple[tuple[float, ...], tuple[float, ...]]]) -> dict[Channel, tuple[float, ...]]:
    """Per channel (boundary, "F" | "B"), the receiving stage's transfer CPU of each micro-batch
    (`cpus`: boundary_cpus): the destination's forward, the source's backward (module docstring)."""
    return {(i, d): x for i, (src, dst) in enumerate(cpus) for d, x in (("F", dst), ("B", src))}
