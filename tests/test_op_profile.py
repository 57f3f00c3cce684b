"""Measured op costs (profiling.op_profile): every op with work gets a time, the times add up to
the whole model's, and the planner sees the measured graph (not a stale copy of it)."""

from __future__ import annotations

import pytest
import torch

from hetsynth.cost_models.compute import FREE_OPS
from hetsynth import capture_model
from hetsynth.instruction_set.graph import Node
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.profiling.op_profile import calibrate_to_model, measure_ops, update_step
from hetsynth.runtime.rank_state import scale_grads, squared_norm


@pytest.fixture(scope="module")
def measured():
    spec = parse_model_ref("gpt:tiny")
    graph = capture_model("gpt:tiny")
    return graph, measure_ops(graph, spec.build("cpu"), spec.make_batch(range(spec.batch_size), seed=1),
                              seconds=0.005)


@pytest.mark.slow
def test_every_op_with_work_is_timed_and_looked_up(measured) -> None:
    graph, timed = measured
    work = [n for n in timed.calls if n.target not in FREE_OPS]
    assert work and all(n.measured_s and n.measured_s > 0 for n in work)
    assert all(timed.node(n.name).measured_s == n.measured_s for n in work)   # no stale lookups
    assert graph.node(work[0].name).measured_s is None                        # the original is unchanged
    assert timed.reference_flops > 1e8 and timed.update_s[0] > 0 and timed.update_s[1] >= 0
    assert timed.fingerprint == graph.fingerprint


def test_calibration_preserves_ratios_and_matches_the_whole() -> None:
    nodes = [Node.model_construct(name=f"n{i}", measured_s=s) for i, s in enumerate([1.0, 3.0, None])]
    out = calibrate_to_model(nodes, 8.0)
    assert [n.measured_s for n in out] == [2.0, 6.0, None]


@pytest.mark.slow
def test_device_scales_replace_the_matmul_rate_ratio(measured) -> None:
    """A kind whose whole model was timed on the device (profiling.model_timing) is charged
    that factor for every op; kinds not timed keep the matmul-rate ratio."""
    from pathlib import Path

    from hetsynth.instruction_set.cluster import load_cluster
    from hetsynth.cost_models.compute import compute_cost, launches
    from hetsynth.planner import baselines
    from hetsynth.planner.problem import Problem

    _, timed = measured
    cluster = load_cluster(Path(__file__).resolve().parents[1] / "configs" / "clusters" / "local-emulated.toml")
    scaled = timed.model_copy(update={"device_scales": {"cpu-slow": 7.0}})
    problem = Problem(scaled, cluster, baselines.even(cluster))
    by_rate = timed.reference_flops / cluster.device_kinds["cpu-fast"].throughput_flops
    assert problem.reference.scales(problem.kinds) == pytest.approx([by_rate, by_rate, 7.0, 7.0])
    op = next(n for n in scaled.calls if n.target not in FREE_OPS)
    cost = compute_cost(op, problem.in_metas(op), False, problem.kinds, problem.reference)
    work = [a - launches(op) * k.kernel_launch_us * 1e-6 for a, k in zip(cost.a, problem.kinds)]
    assert work == pytest.approx([op.measured_s * s for s in (by_rate, by_rate, 7.0, 7.0)])


def test_device_scales_compare_equal_rows() -> None:
    from hetsynth.profiling.model_timing import device_scales

    records = [{"kind": "fast", "rows": 10, "seconds": 1.0}, {"kind": "fast", "rows": 20, "seconds": 3.0},
               {"kind": "slow", "rows": 10, "seconds": 2.0}, {"kind": "slow", "rows": 0, "seconds": 0.0}]
    reference = {10: 0.5, 20: 1.0}
    assert device_scales(records, reference) == {"fast": pytest.approx(2.5), "slow": pytest.approx(4.0)}


def test_the_timed_update_steps_on_gradients_of_real_magnitude() -> None:
    """The profiled optimizer step keeps its gradients' magnitude: clipped again and again by
    max_norm / norm they sank into denormals, where AdamW runs several times slower than on
    real gradients, and the update was over-predicted (a routed-experts plan by 19%)."""
    step, grads = update_step([torch.randn(64, 64), torch.randn(64)])
    for _ in range(200):
        step()
    smallest = min(float(g.abs().max()) for g in grads)
    assert smallest > 0.1, smallest


def test_the_runtime_norm_is_the_float64_sum_of_squares() -> None:
    grads = [torch.randn(5, 3), torch.randn(7)]
    assert float(squared_norm(grads)) == pytest.approx(sum(float(g.double().pow(2).sum()) for g in grads), rel=1e-12)
    before = [g.clone() for g in grads]
    scale_grads(grads, 1.5)  # clipping never grows a gradient
    assert all(torch.equal(a, b) for a, b in zip(grads, before))
    scale_grads(grads, 0.5)
    assert all(torch.equal(a, b * 0.5) for a, b in zip(grads, before))
