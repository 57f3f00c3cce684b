"""Classes of interchangeable devices (cost_models.device_classes): the planner's per-class
costs, shares and LP equal the per-device ones, and the classes stay few as clusters grow."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetsynth.cost_models.device_classes import DeviceClasses
from hetsynth.cost_models.linear_cost import LinearCost
from hetsynth.cost_models.memory import MemoryTerm
from hetsynth.cost_models.terms import Cost, Form, Shares, Term
import hetsynth
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.planner import baselines
from hetsynth.planner.step_cost import program_terms
from hetsynth.planner.problem import Problem
from hetsynth.planner.ratios import solve_ratios

HAP = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "hap-paper.toml"


@pytest.fixture(scope="module")
def problem() -> tuple[Problem, hetsynth.Plan]:
    cluster = load_cluster(HAP)
    plan = hetsynth.plan("gpt:tiny,batch_size=100", cluster=cluster)  # 100 rows: uneven rounding
    return Problem(plan.graph, cluster, plan.sharding_ratios), plan


def _per_device(t: Term, classes: DeviceClasses) -> Term:
    x = classes.expand
    memory = None if t.memory is None else MemoryTerm(x(t.memory.fixed), x(t.memory.per_share))
    at = None if t.memory_at is None else Shares(x(t.memory_at.values), t.memory_at.kind)
    return Term(_expand(t.time, x), memory, at)


def _expand(c: Cost, x) -> Cost:
    """A cost over classes as the same cost over devices (forms over all entries)."""
    if isinstance(c, Form):
        assert c.devices is None
        return Form(LinearCost(x(c.cost.a), x(c.cost.b)), Shares(x(c.shares.values), c.shares.kind), c.category)
    return type(c)(tuple(_expand(p, x) for p in c.parts))


@pytest.mark.slow
def test_a_class_holds_devices_with_equal_shares(problem: tuple[Problem, hetsynth.Plan]) -> None:
    pb, plan = problem
    assert pb.width < pb.cluster.num_devices
    for tensor, layouts in plan.shards.items():
        for layout in layouts:
            assert pb.lengths.rank_shares(tensor, layout) == pb.devices.expand(pb.shares(tensor, layout))


@pytest.mark.slow
def test_lp_over_classes_equals_lp_over_devices(problem: tuple[Problem, hetsynth.Plan]) -> None:
    """Devices of a class have the same constraints, so the per-device LP has a symmetric
    optimum: its objective equals the LP with one variable per class."""
    pb, plan = problem
    terms = program_terms(pb, plan.instructions)
    caps = [k.memory_gib for k in pb.kinds]
    by_class = solve_ratios(terms, caps, classes=pb.devices)
    nodes = [pb.mesh.node(r) for r in range(pb.cluster.num_devices)]
    by_device = solve_ratios([_per_device(t, pb.devices) for t in terms], pb.devices.expand(caps), nodes=nodes)
    assert by_class.objective_s == pytest.approx(by_device.objective_s, rel=1e-7)
    ratios = pb.devices.expand(by_class.ratios)
    assert sum(ratios) == pytest.approx(1.0)


def test_classes_stay_few_as_the_cluster_grows() -> None:
    graph = hetsynth.capture_model("gpt:tiny,batch_size=4096")
    widths = {}
    for n in (64, 4096):
        cluster = load_cluster(HAP).scaled(n // 8)
        widths[n] = Problem(graph, cluster, baselines.proportional(cluster)).width
    assert widths[4096] <= 4 * widths[64] and widths[4096] < 64
