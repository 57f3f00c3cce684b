"""The schedule simulation's inputs from a pipeline's stage plans (planner.stage_times), and the
slow-link cluster spec bench/pipeline.py plans on. Planning only (no process group)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetsynth import capture_model
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.planner.pipeline import block_starts, make_pipeline_plan
from hetsynth.planner.planner import make_plan
from hetsynth.planner.stage_times import global_s, nics, shared_s, stage_phases

ROOT = Path(__file__).resolve().parents[1]
LOCAL = load_cluster(ROOT / "configs" / "clusters" / "local-emulated.toml")


@pytest.fixture(scope="module")
def pipeline():
    """gpt:tiny in two stages, one per node of local-emulated, 2 micro-batches."""
    graph = capture_model("gpt:tiny")
    spmd = make_plan(graph, LOCAL, width=8, progress=False, with_baselines=False)
    cut, n = block_starts(graph)[1], len(graph.calls)
    return make_pipeline_plan(spmd, parse_model_ref("gpt:tiny"), [(range(0, 2), (0, cut)), (range(2, 4), (cut, n))],
                              num_micro=2, width=8)


@pytest.mark.slow
def test_single_device_phases_add_up_to_its_step():
    """On one device nothing synchronises: F + B + U is the plan's own step prediction."""
    plan = make_plan(capture_model("gpt:tiny"), LOCAL.first(1), width=8, progress=False, with_baselines=False)
    ph = stage_phases(plan)
    assert ph.sync_s == 0.0 and ph.forward_s > 0 and ph.backward_s > ph.forward_s and ph.update_s > 0
    assert ph.forward_s + ph.backward_s + ph.update_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)


@pytest.mark.slow
def test_stage_phases_charge_one_coalesced_sync_per_axis(pipeline):
    from hetsynth.planner.stage_times import all_reduce_s

    p = pipeline.pipeline
    for st in p.stages:
        plan = st.plans[max(st.plans)]
        synced = [i for i in plan.instructions if i.kind == "all_reduce" and i.phase == "backward"]
        assert synced and {i.axis for i in synced} == {"all"}  # data parallel inside the node
        nbytes = sum(plan.graph.node(i.tensor).out.nbytes for i in synced)
        assert stage_phases(plan).sync_s == pytest.approx(all_reduce_s(LOCAL, st.ranks, nbytes), rel=1e-9)


@pytest.mark.slow
def test_shared_embedding_and_world_scalars_cost_time(pipeline):
    p = pipeline.pipeline
    assert shared_s(p.stages, LOCAL) > 0.0  # GPT's tied tok.weight lives on both stages
    assert shared_s(p.stages[:1], LOCAL) == 0.0
    assert global_s(LOCAL) > 0.0 and global_s(LOCAL.first(1)) == 0.0


def test_boundary_nics_cross_the_link_both_ways(pipeline):
    p, hosts = pipeline.pipeline, LOCAL.rank_nodes()
    b = max(p.micro_batches)
    for bd in p.boundaries:
        assert nics(bd, b, hosts, "F") == {(0, "out"), (1, "in")}
        assert nics(bd, b, hosts, "B") == {(1, "out"), (0, "in")}
    assert nics(p.boundaries[0], b, [0, 0, 0, 0], "F") == frozenset()  # all on one host: no NIC


def test_slow_link_spec_loads_with_its_emulation():
    spec = load_cluster(ROOT / "configs" / "clusters" / "slow-link-emulated.toml")
    assert [len(n.devices) for n in spec.nodes] == [2, 2]
    assert spec.links.inter_node_bandwidth_gbps == 0.05 < LOCAL.links.inter_node_bandwidth_gbps
    assert spec.emulation is not None and sum(spec.emulation.cpu_quota[d.kind] for d in spec.devices) == 1.5
    assert spec.emulation.burst_kib == 16 and LOCAL.emulation is not None and LOCAL.emulation.burst_kib == 32


def test_every_recosting_of_a_one_level_plan_keeps_its_one_level_mesh(monkeypatch):
    """stage_phases, the trace's step, without_fusion and the shortfall message rebuild the
    plan's problem (planner.problem.plan_problem): a DP-CP plan has a one-level mesh, and each
    of them must cost it on one, not on the default two-level one."""
    from hetsynth.trace import predicted_step
    from hetsynth.planner import baselines
    from hetsynth.planner.planner import shortfall_message, without_fusion
    from hetsynth.planner.problem import Problem

    plan = make_plan(capture_model("gpt:tiny"), LOCAL, ratios=baselines.proportional(LOCAL),
                     restrictions=baselines.DP, width=8, progress=False, with_baselines=False)
    assert not plan.mesh.two_level
    built, init = [], Problem.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self.mesh.two_level)
    monkeypatch.setattr(Problem, "__init__", spy)
    for recost in (stage_phases, predicted_step, without_fusion, shortfall_message):
        built.clear()
        recost(plan)
        assert built and not any(built), recost.__name__
