"""Synthesis end to end on small models: quality against baselines, degenerate cases,
fixed ratios, memory infeasibility, JSON round trip and version checks."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

import hetsynth
from hetsynth.instruction_set.cluster import cluster_from_dict, load_cluster
from hetsynth.instruction_set.layouts import R, Layout
from hetsynth.instruction_set.plan import PLAN_VERSION, PlanError, load_plan, plan_from_json
from hetsynth.planner import baselines
from hetsynth.planner.planner import PlanInfeasible, search_plan
from hetsynth.planner.problem import Problem, Restrictions
from hetsynth.planner.synthesis import synthesize

CLUSTERS = Path(__file__).resolve().parents[1] / "configs" / "clusters"


@pytest.fixture(scope="module")
def gpt_a100_t4() -> hetsynth.Plan:
    return hetsynth.plan("gpt:tiny", cluster=str(CLUSTERS / "a100-t4.toml"))


@pytest.mark.slow
def test_plan_beats_or_matches_every_baseline(gpt_a100_t4: hetsynth.Plan) -> None:
    plan = gpt_a100_t4
    assert plan.predicted.fits
    for name, b in plan.baselines.items():
        assert plan.predicted.step_time_s <= b.step_time_s * (1 + 1e-9), name
    assert set(plan.baselines) == {"dp_ev", "dp_cp", "megatron"}


@pytest.mark.slow
def test_fast_devices_get_bigger_shares(gpt_a100_t4: hetsynth.Plan) -> None:
    a100, t4 = gpt_a100_t4.sharding_ratios[0], gpt_a100_t4.sharding_ratios[-1]
    assert a100 > t4 and sum(gpt_a100_t4.sharding_ratios) == pytest.approx(1.0)


def test_json_round_trip(gpt_a100_t4: hetsynth.Plan, tmp_path: Path) -> None:
    hetsynth.save_plan(gpt_a100_t4, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json") == gpt_a100_t4


def test_other_version_is_refused(gpt_a100_t4: hetsynth.Plan, tmp_path: Path) -> None:
    raw = json.loads(gpt_a100_t4.model_dump_json())
    raw["version"] = PLAN_VERSION + 1
    with pytest.raises(PlanError, match=f"version {PLAN_VERSION + 1}.*reads versions 1 to {PLAN_VERSION}"):
        plan_from_json(raw, "old.json")
    with pytest.raises(PlanError, match="not a hetsynth plan"):
        plan_from_json({"hello": 1}, "x.json")


def test_every_sharded_layout_has_lengths(gpt_a100_t4: hetsynth.Plan) -> None:
    plan = gpt_a100_t4
    nodes, per_node = plan.mesh.num_nodes, plan.mesh.per_node
    for ins in plan.instructions:
        if not ins.layout.is_shard:
            continue
        for dim, lengths in plan.lengths(ins.tensor, ins.layout).items():
            size = plan.graph.node(ins.tensor).outputs[0].shape[dim]
            assert len(lengths) == plan.cluster.num_devices
            if not ins.layout.is_two_level:       # split over all devices
                assert sum(lengths) == size
            elif ins.layout.outer.dim == dim:     # across nodes: one block per node
                assert sum(lengths[::per_node]) == size
            else:                           # inside every node
                assert all(sum(lengths[j * per_node:(j + 1) * per_node]) == size for j in range(nodes))


@pytest.mark.slow
def test_homogeneous_cluster_gives_even_ratios() -> None:
    plan = hetsynth.plan("bert:tiny,batch_size=64", cluster=str(CLUSTERS / "a100x8.toml"))
    assert max(plan.sharding_ratios) - min(plan.sharding_ratios) < 1e-6
    for name, b in plan.baselines.items():
        assert plan.predicted.step_time_s <= b.step_time_s * (1 + 1e-9), name


@pytest.mark.slow
def test_fixed_ratios_are_kept() -> None:
    plan = hetsynth.plan("gpt:tiny", cluster=str(CLUSTERS / "local-emulated.toml"),
                         ratios=[0.4, 0.3, 0.2, 0.1])
    assert plan.sharding_ratios == pytest.approx((0.4, 0.3, 0.2, 0.1))
    with pytest.raises(ValueError, match="3 ratios given for 4 devices"):
        hetsynth.plan("gpt:tiny", cluster=str(CLUSTERS / "local-emulated.toml"), ratios=[0.5, 0.3, 0.2])


def _small_memory(memory_gib: float) -> dict:
    return {"name": "tiny-mem", "device_kinds": {"small": {"throughput_flops": 1e12, "memory_gib": memory_gib}},
            "nodes": [{"name": "n", "kind": "small", "num_devices": 2}],
            "links": {"intra_node_bandwidth_gbps": 100, "inter_node_bandwidth_gbps": 10}}


@pytest.mark.slow
def test_infeasible_memory_names_the_device() -> None:
    # gpt:tiny's training state (0.42 MiB) and its unavoidable activations fit in the two devices
    # together; no plan does: the message names the device, the shortfall and what was tried
    with pytest.raises(PlanInfeasible) as info:  # stages=1: SPMD only (the default would try a pipeline)
        hetsynth.plan("gpt:tiny", cluster=cluster_from_dict(_small_memory(0.0003)), stages=1)
    msg = str(info.value)
    assert "the best plan found needs" in msg and ("'n/0'" in msg or "'n/1'" in msg)
    assert "short by" in msg and "GiB" in msg and "recomputation of 2 blocks" in msg


@pytest.mark.slow
def test_memory_lower_bound_refuses_before_any_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """State and unavoidable activations (0.54 MiB) beyond both devices (0.5 MiB), though the
    state alone (0.42 MiB) fits: refused by the lower bound, no search runs."""
    import hetsynth.planner.baselines as baselines
    import hetsynth.planner.planner as planner_module

    def no_search(*args, **kwargs):
        raise AssertionError("a search ran before the lower bound refused the problem")

    monkeypatch.setattr(planner_module, "synthesize", no_search)
    monkeypatch.setattr(baselines, "synthesize", no_search)
    graph = hetsynth.capture_model("gpt:tiny")
    with pytest.raises(PlanInfeasible, match=r"all 2 blocks recomputed .* short by [0-9.e-]+ GiB"):
        search_plan(graph, cluster_from_dict(_small_memory(0.00025)), progress=False)


def test_training_state_beyond_all_memory_is_refused_before_the_search() -> None:
    graph = hetsynth.capture_model("gpt:tiny")
    need_gib = 4 * 4 * graph.num_params / 2**30
    with pytest.raises(PlanInfeasible, match=rf"alone need {need_gib:.2f} GiB .* hold 0.0002 GiB in all"):
        search_plan(graph, cluster_from_dict(_small_memory(0.0001)), progress=False)


@pytest.mark.slow
def test_bounded_search_matches_exhaustive_on_a_small_model() -> None:
    graph = hetsynth.capture_model("vit:tiny")
    cluster = load_cluster(CLUSTERS / "a100-t4.toml")
    ratios = baselines.proportional(cluster)
    bounded = synthesize(Problem(graph, cluster, ratios), progress=False)
    wide = synthesize(Problem(graph, cluster, ratios), width=10_000, progress=False)
    assert bounded.cost_s == pytest.approx(wide.cost_s, rel=1e-9)
    assert wide.exact


class _Linear(torch.nn.Module):
    def __init__(self, features: int, out: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(features, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).square().mean()




@pytest.mark.parametrize("tokens,expect_sfb", [(8, True), (8192, False)])
def test_sfb_chosen_by_cost_where_it_pays(tokens: int, expect_sfb: bool) -> None:
    """A 2048 x 2048 weight on the HAP cluster: SFB (gather 8 tokens' factors) beats the
    all-reduce of 16 MiB; at 8192 tokens (> 2 * in * out / (in + out) = 2048) it does not.
    The sync instruction records both predicted alternatives."""
    from hetsynth.planner.planner import DP_SEED, make_plan

    cluster = load_cluster(CLUSTERS / "hap-paper.toml").first(8)
    with torch.device("meta"):
        model = _Linear(2048, 2048)
    graph = hetsynth.capture_model(model, (torch.zeros(tokens, 2048, device="meta"),))
    plan = make_plan(graph, cluster, progress=False, with_baselines=False, restrictions=DP_SEED)
    sync = next(i for i in plan.instructions if i.tensor == "p_fc_weight" and i.phase == "backward")
    assert set(sync.alternatives) == {"all_reduce", "sfb"}
    assert (sync.kind == "sfb") == expect_sfb, sync.alternatives
    assert sync.predicted_s == pytest.approx(min(sync.alternatives.values()))


def test_without_sfb_is_the_same_plan_with_all_reduce() -> None:
    from hetsynth.planner.planner import DP_SEED, make_plan, without_sfb

    cluster = load_cluster(CLUSTERS / "local-emulated.toml")
    graph = hetsynth.capture_model("vgg:tiny")
    force = {n.name: "S0" for n in graph.calls if n.target == "aten.linear.default"}
    plan = make_plan(graph, cluster, progress=False, with_baselines=False,
                     restrictions=dataclasses.replace(DP_SEED, force_sfb=True, force=force))
    sfb = {i.tensor for i in plan.instructions if i.kind == "sfb"}
    assert sfb == {"p_fc1_weight", "p_fc2_weight", "p_fc3_weight"}
    other = without_sfb(plan)
    assert not any(i.kind == "sfb" for i in other.instructions)
    assert {i.tensor for i in other.instructions if i.kind == "all_reduce" and i.phase == "backward"} >= sfb
    assert other.sharding_ratios == plan.sharding_ratios and other.shards == plan.shards
    assert other.predicted.step_time_s != pytest.approx(plan.predicted.step_time_s)


def test_inapplicable_variants_stay_out_of_plans() -> None:
    """The hierarchical all-reduce does not apply along the cross-node axis: it is not among
    the alternatives a plan records (they must all be finite numbers to round-trip JSON)."""
    graph = hetsynth.capture_model("gpt:tiny")
    cluster = load_cluster(CLUSTERS / "local-emulated.toml")
    pb = Problem(graph, cluster, baselines.even(cluster))
    linear = next(n.name for n in graph.calls if n.target == "aten.linear.default")
    step = pb.collective(linear, "all_reduce", Layout.parse("P|S2"), Layout.parse("R|S2"), "outer")
    assert step.variant == "ring" and all(math.isfinite(c) for _, c in step.alternatives)


@pytest.mark.slow
def test_data_parallel_space_picks_sfb_where_it_pays() -> None:
    """`hetsynth plan --data-parallel`: VGG's classifier at 32 images gets SFB for its two big
    weights (chosen by cost, not forced), the 1024 x 10 one and GPT's weights keep the
    all-reduce; every parameter stays replicated."""
    cluster = str(CLUSTERS / "local-emulated.toml")
    vgg = hetsynth.plan("vgg:small-cpu", cluster=cluster, batch_size=32, data_parallel=True)
    assert {i.tensor for i in vgg.instructions if i.kind == "sfb"} == {"p_fc1_weight", "p_fc2_weight"}
    assert all(i.layout is R for i in vgg.instructions if i.kind == "param")
    gpt = hetsynth.plan("gpt:small-cpu", cluster=cluster, data_parallel=True)
    assert not any(i.kind == "sfb" for i in gpt.instructions)


@pytest.mark.parametrize("layout", ["R", "P"])
@pytest.mark.slow
def test_forced_layout_in_a_repeated_layer_is_kept(layout: str) -> None:
    """Repeated layers share their search moves; a layer with a forced layout must not take
    the moves of its unforced twin: the last block's first linear is made in the forced
    layout (the free search makes it in another), at a cost no lower than the free one."""
    graph = hetsynth.capture_model("gpt:tiny")
    cluster = load_cluster(CLUSTERS / "a100-t4.toml")
    ratios = baselines.proportional(cluster)
    last = [n.name for n in graph.calls if n.target == "aten.linear.default"][-7]  # the last block's first

    def made(restrictions: Restrictions | None) -> tuple[float, dict[str, Layout]]:
        result = synthesize(Problem(graph, cluster, ratios, restrictions), progress=False)
        return result.cost_s, {i.node: i.layout for i in result.instructions if i.kind == "compute"}

    (free_cost, free), (forced_cost, forced) = made(None), made(Restrictions(force={last: layout}))
    assert free[last] != Layout.parse(layout)
    assert forced[last] == Layout.parse(layout)
    assert forced_cost >= free_cost * (1 - 1e-12)
