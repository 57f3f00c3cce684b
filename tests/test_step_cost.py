"""The step's cost with the gradient buckets' all-reduces overlapped with the backward pass
(planner.step_cost): the max form by hand, the LP lowering of it, and the bucket cap the plan
records."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetsynth.cost_models.linear_cost import LinearCost
from hetsynth.cost_models.terms import Form, Overlap, Shares, ShareKind, Term, exposed, seconds
from hetsynth import capture_model
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.instruction_set.kinds import Category
from hetsynth.planner.planner import make_plan
from hetsynth.planner.ratios import solve_ratios
from hetsynth.instruction_set.sync import SYNC_MESSAGES
from hetsynth.planner.problem import Problem
from hetsynth.planner.step_cost import backward_overlap, bucket_sync, program_terms
from hetsynth.profiling.profiler import measured_spec

CLUSTER = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "local-emulated.toml"


def const(seconds_: float, category: Category = Category.COMPUTE) -> Form:
    return Form(LinearCost.constant(seconds_, 1), Shares((1.0,), ShareKind.NONE), category)


def test_stream_chain_by_hand() -> None:
    """Ten 1 s backward halves; buckets ready after 2, 5 and 9 s (the backward of instructions
    8, 5 and 1), syncs of 1, 4 and 2 s: the stream ends at max(max(0, 2) + 1, 5) + 4 = 9,
    then max(9, 9) + 2 = 11; 1 s exposed."""
    backward = [const(1.0)] * 10
    sync = [const(s, Category.COMMUNICATION) for s in (1.0, 4.0, 2.0)]
    chain = backward_overlap(backward, [8, 5, 1], sync)
    assert seconds(chain) == pytest.approx(11.0)
    assert exposed(chain, Category.COMMUNICATION) == pytest.approx(1.0)
    hidden = [const(s, Category.COMMUNICATION) for s in (1.0, 4.0, 0.5)]
    assert seconds(backward_overlap(backward, [8, 5, 1], hidden)) == pytest.approx(10.0)
    assert seconds(backward_overlap(backward, [8, 5, 1], hidden, hidden)) == pytest.approx(15.5)  # CPU-bound
    lost = [const(0.2 * s.cost.a[0]) for s in hidden]  # gamma = 0.2
    assert seconds(backward_overlap(backward, [8, 5, 1], hidden, lost)) == pytest.approx(11.1)


def test_lp_sees_the_overlap() -> None:
    """Two devices, backward work max(2 r0, 4 r1) of which max(r0, 2 r1) comes before the
    one bucket (1 s) is ready: the LP's optimum is r = (2/3, 1/3), max(4/3, 2/3 + 1) = 5/3,
    the same as the overlap's seconds at those ratios (the shared form is one variable)."""
    first = Form(LinearCost((0.0, 0.0), (1.0, 2.0)), Shares((0.5, 0.5), ShareKind.FLAT), Category.COMPUTE)
    rest = Form(LinearCost((0.0, 0.0), (1.0, 2.0)), Shares((0.5, 0.5), ShareKind.FLAT), Category.COMPUTE)
    sync = Form(LinearCost.constant(1.0, 2), Shares((1.0, 1.0), ShareKind.NONE), Category.COMMUNICATION)
    chain = backward_overlap([rest, first], [1], [sync])
    solution = solve_ratios([Term(chain)], [1.0, 1.0])
    assert solution.ratios == pytest.approx((2 / 3, 1 / 3), abs=1e-6)
    assert solution.objective_s == pytest.approx(5 / 3, rel=1e-6)


@pytest.mark.slow
def test_plan_records_the_cap_it_predicts_fastest() -> None:
    graph = capture_model("gpt:tiny")
    plan = make_plan(graph, load_cluster(CLUSTER), progress=False, with_baselines=False)
    sync = plan.gradient_sync
    assert sync.chosen_from and min(sync.chosen_from.values()) == pytest.approx(plan.predicted.step_time_s)
    forced = make_plan(graph, load_cluster(CLUSTER), progress=False, with_baselines=False, bucket_cap=2**30)
    assert forced.gradient_sync.bucket_cap_bytes == 2**30 and len(forced.gradient_sync.buckets) <= 2
    assert forced.predicted.step_time_s >= plan.predicted.step_time_s - 1e-12


def with_gamma(cluster, gamma: float, per_message_us: float = 0.0):
    kinds = {k: v.model_copy(update={"transfer_cpu_share": gamma, "transfer_cpu_us_per_message": per_message_us})
             for k, v in cluster.device_kinds.items()}
    return cluster.model_copy(update={"device_kinds": kinds})


@pytest.mark.slow
def test_transfer_cpu_share_charges_the_overlapped_compute() -> None:
    """gamma = 1 (every transfer second taken from the compute): the backward costs its
    compute plus every bucket's sync, the additive form; gamma = 0 hides some of it. The
    program and buckets are the same, only the cluster's measured gamma differs."""
    graph, cluster = capture_model("gpt:tiny"), load_cluster(CLUSTER)
    plan = make_plan(graph, cluster, progress=False, with_baselines=False, bucket_cap=2**18)
    costs = {}
    for gamma, per_message in ((0.0, 0.0), (1.0, 0.0), (1.0, 1000.0)):
        pb = Problem(graph, with_gamma(cluster, gamma, per_message), plan.sharding_ratios)
        terms = program_terms(pb, plan.instructions, plan.gradient_sync.buckets)
        overlap = next(t.time for t in terms if isinstance(t.time, Overlap))
        whole, *branches = overlap.parts
        costs[gamma + per_message] = (seconds(overlap), seconds(whole), max(seconds(b) for b in branches))
    assert costs[1.0][0] == pytest.approx(costs[1.0][1]) and costs[1.0][1] >= costs[1.0][2]
    syncs = sum(seconds(bucket_sync(pb, b)) for b in plan.gradient_sync.buckets)
    assert costs[1.0][1] == pytest.approx(costs[0.0][1] + syncs)
    assert costs[0.0][0] < costs[1.0][0]
    messages = sum(SYNC_MESSAGES[b.variant] for b in plan.gradient_sync.buckets)  # 1 ms each
    assert costs[1001.0][1] == pytest.approx(costs[1.0][1] + 1e-3 * messages)


def test_measured_spec_records_the_transfer_cpu_share() -> None:
    """The profiler fits each kind's gamma and cost per message to its ranks' measurements
    together (profiling.profiler.fit_transfer_cpu)."""
    cluster = load_cluster(CLUSTER)
    def rows(gamma: float, per_message_s: float) -> list[tuple[int, float, float]]:
        return [(k, s, per_message_s * k + gamma * s) for k, s in ((8, 0.02), (1, 0.1), (1, 0.4))]

    compute = [{"throughput_flops": 1e9, "memory_bandwidth_gbyte_s": 1.0, "kernel_launch_us": 10.0,
                "transfer_cpu_rows": rows(g, m)} for g, m in ((0.3, 1e-3), (0.3, 1e-3), (0.8, 0.0), (0.8, 0.0))]
    spec = measured_spec(cluster, compute, {})
    fast, slow = (spec.device_kinds[cluster.devices[i].kind] for i in (0, 2))
    assert (fast.transfer_cpu_share, fast.transfer_cpu_us_per_message) == pytest.approx((0.3, 1000.0))
    assert (slow.transfer_cpu_share, slow.transfer_cpu_us_per_message) == pytest.approx((0.8, 0.0), abs=1e-9)


def test_measured_spec_records_point_to_point_apart_from_all_reduces() -> None:
    """The point-to-point rows (profiling.overlap.p2p_cpu_rows) get their own fit; without them
    the kind has none and a boundary transfer falls back to the all-reduces' (DeviceKind.p2p_cpu)."""
    from hetsynth.profiling.overlap import partners

    cluster = load_cluster(CLUSTER)
    def rows(gamma: float, per_message_s: float) -> list[tuple[int, float, float]]:
        return [(k, s, per_message_s * k + gamma * s) for k, s in ((8, 0.02), (2, 0.1), (2, 0.4))]

    base = {"throughput_flops": 1e9, "memory_bandwidth_gbyte_s": 1.0, "kernel_launch_us": 10.0,
            "transfer_cpu_rows": rows(0.5, 4e-3)}
    compute = [base | {"p2p_cpu_rows": rows(0.1, 1e-3)} for _ in cluster.devices]
    kind = measured_spec(cluster, compute, {}).device_kinds[cluster.devices[0].kind]
    assert (kind.p2p_cpu_share, kind.p2p_cpu_us_per_message) == pytest.approx((0.1, 1000.0))
    assert kind.p2p_cpu() == pytest.approx((0.1, 1000.0))
    bare = measured_spec(cluster, [base | {"p2p_cpu_rows": []} for _ in cluster.devices], {})
    kind = bare.device_kinds[cluster.devices[0].kind]
    assert kind.p2p_cpu_share is None and kind.p2p_cpu() == pytest.approx((0.5, 4000.0))
    assert [partners([0, 0, 1, 1], r) for r in range(4)] == [(2, 2), (3, 3), (0, 0), (1, 1)]
    assert [partners([0, 1, 2], r) for r in range(3)] == [(1, 2), (2, 0), (0, 1)]
    assert partners([0, 0, 1], 1) is None and partners([0, 0], 0) is None
