"""Expert parallelism for HuggingFace MoE models (`experts=routed`: instruction_set.experts_op):
the planner splits the experts over devices unevenly, and a 4-rank run of such a plan, the
router's auxiliary loss included, matches single-device training in float64."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

import hetsynth
from hetsynth import capture_model
from hetsynth.cli import main
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.instruction_set.experts_op import OP, with_expert_loads
from hetsynth.instruction_set.layouts import R, Layout, Replicate
from hetsynth.instruction_set.rules import registry
from hetsynth.planner.planner import make_plan
from hetsynth.planner import problem
from hetsynth.planner.problem import Restrictions
from hetsynth.runtime.check import check_on_pool
from hetsynth.runtime.config import TrainConfig

pytestmark = pytest.mark.slow
pytest.importorskip("transformers.integrations.moe")

CLUSTER = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "local-emulated.toml"
# 8 experts of FFN 64 on hidden 32: the experts are most of the weights; router loss on
TINY = ("hf:mixtral,experts=routed,num_layers=1,num_local_experts=8,ffn_hidden=64,"
        "output_router_logits=true,router_aux_loss_coef=0.1")


def _expert_params(graph) -> list[str]:
    return [t for n in graph.calls if n.target == OP for t in n.inputs[3:5]]


def _only(monkeypatch: pytest.MonkeyPatch, local: str) -> None:
    """The routed-experts op keeps its all-replicated rule and the expert-parallel rule `local`
    only, so that the search takes that one (the workers' processes keep every rule: a
    plan's instruction names its rule by its layouts)."""
    every = registry._REGISTRY[OP]
    monkeypatch.setitem(registry._REGISTRY, OP, lambda node, metas: [
        r for r in every(node, metas) if r.local == local or all(l is R for l in (*r.inputs, r.output))])
    monkeypatch.setattr(registry, "_rule_fn", registry._rule_fn.__wrapped__)  # uncached while patched
    monkeypatch.setattr(problem, "_PER_GRAPH", {})  # no rules kept from a graph planned before


@pytest.mark.parametrize("local", ["experts_sharded", "experts_dispatched"])
@pytest.mark.parametrize("experts_layout, lengths", [
    ("S0", [3, 2, 2, 1]),     # over all devices: 8 experts by 0.4, 0.3, 0.2, 0.1
    ("R|S0", [5, 3, 5, 3]),   # inside each node: 8 by 0.4 : 0.3 and 0.2 : 0.1
])
def test_uneven_expert_parallel_run_matches_one_device(pools, monkeypatch: pytest.MonkeyPatch, local: str,
                                                       experts_layout: str, lengths: list[int]) -> None:
    """Experts split unevenly, tokens brought to them (`experts_sharded`: all-gathered, the
    output reduce-scattered) or sent to them (`experts_dispatched`: each pair to its expert's
    rank and back, an all-to-all each way, among all ranks or the node's): a 4-rank run
    matches single-device training in float64."""
    _only(monkeypatch, local)
    graph = capture_model(TINY)
    force = {p: experts_layout for p in _expert_params(graph)}
    if local == "experts_dispatched":  # its output in the experts' layout (else all-R may be cheaper on so small a model)
        force |= {n.name: experts_layout for n in graph.calls if n.target == OP}
    cluster = load_cluster(CLUSTER)
    plan = make_plan(graph, cluster, ratios=[0.4, 0.3, 0.2, 0.1], progress=False,
                     restrictions=Restrictions(force=force, two_level=experts_layout != "S0"), with_baselines=False)
    experts = [i for i in plan.instructions if i.kind == "compute" and local in i.local]
    assert experts and all(str(i.inputs[3]) == experts_layout for i in experts), [i.describe() for i in experts]
    layout = Layout.parse(experts_layout)
    assert list(plan.lengths(_expert_params(graph)[0], layout)[0]) == lengths
    float32, float64 = check_on_pool(pools.get(4), plan, TrainConfig(steps=3, lr=1e-2))
    assert float64.ok and not float64.lowered, float64.describe()
    assert float32.ok, float32.describe()


def test_planner_chooses_uneven_expert_parallelism() -> None:
    """Experts dominate the weights (8 experts, hidden 256, FFN 1024), 2 fast + 2 slow devices:
    the search splits the experts, more of them on the fast devices."""
    ref = "hf:mixtral,experts=routed,num_layers=1,hidden=256,ffn_hidden=1024,num_local_experts=8,num_heads=4"
    graph = capture_model(ref)
    plan = make_plan(graph, load_cluster(CLUSTER), progress=False, with_baselines=False)
    chosen = [i for i in plan.instructions if i.node and i.kind == "compute" and graph.node(i.node).target == OP]
    assert len(chosen) == 1 and chosen[0].local in ("experts_sharded", "experts_dispatched"), chosen
    lengths = list(plan.lengths(_expert_params(graph)[0], chosen[0].inputs[3])[0])
    assert sum(lengths) == 8 and min(lengths[:2]) > max(lengths[2:]), lengths


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "glm4_moe", "hunyuan_v1_moe", "ernie4_5_moe",
                                    "granitemoeshared"])
def test_moe_families_plan_and_train_exactly(pools, family: str) -> None:
    """MoE families beside Mixtral, Qwen2-MoE and OLMoE: DeepSeek-V2 (complex rotary: polar,
    view_as_complex, view_as_real), DeepSeek-V3 (slice assignment: aten.copy), GLM-4-MoE and
    Hunyuan (shared and routed experts), ERNIE-4.5-MoE, Granite-MoE-shared (its own parallel
    experts) capture with no flags, and a 4-rank plan with uneven ratios matches
    single-device training in float64."""
    graph = capture_model(f"hf:{family}")
    assert not graph.fallback_ops
    plan = make_plan(graph, load_cluster(CLUSTER), ratios=[0.4, 0.3, 0.2, 0.1], progress=False,
                     with_baselines=False)
    float32, float64 = check_on_pool(pools.get(4), plan, TrainConfig(steps=2, lr=1e-2))
    assert float64.ok, float64.describe()
    assert float32.ok, float32.describe()


def test_expert_loads_are_checked_and_scaled() -> None:
    """User-given expert loads: one list for every MoE op or by op name or module path, scaled
    to sum to 1; a wrong count, a negative or non-finite number, an unknown name or a model
    without routed experts is a ValueError naming it."""
    graph = capture_model(TINY)
    op = next(n for n in graph.calls if n.target == OP)
    loaded = with_expert_loads(graph, [2, 1, 1, 0, 0, 0, 0, 0])
    assert loaded.expert_loads[op.name] == (0.5, 0.25, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert with_expert_loads(graph, {op.module_path: [1] * 8}).expert_loads[op.name] == (0.125,) * 8
    for loads, words in (([1, 2], "2 numbers for 8 experts"), ([1] * 7 + [-1], "-1.0"),
                         ([1] * 7 + [math.nan], "nan"), ([0] * 8, "not all zero"),
                         ({"model.nowhere": [1] * 8}, "'model.nowhere'"), ([None] * 8, "None is not a number"),
                         ([True] * 8, "True is not a number"), ({}, "an empty mapping")):
        with pytest.raises(ValueError, match=re.escape(words)):
            with_expert_loads(graph, loads)
    with pytest.raises(ValueError, match="no routed-experts op"):
        with_expert_loads(capture_model("gpt:tiny"), [1, 1])


def test_expert_loads_price_each_devices_experts() -> None:
    """Experts split 3 : 2 : 2 : 1 (ratios 0.4, 0.3, 0.2, 0.1), half the pairs routed to the
    last expert (the slow device's): the op's work on each device is the sum of its experts'
    loads, and the plan with those loads is predicted slower than with uniform routing."""
    graph = capture_model(TINY)
    op = next(n for n in graph.calls if n.target == OP)
    skewed = with_expert_loads(graph, [1] * 7 + [7])
    cluster, ratios = load_cluster(CLUSTER), [0.4, 0.3, 0.2, 0.1]
    pb = problem.Problem(skewed, cluster, ratios, Restrictions(two_level=False))
    per_device = pb.devices.expand(pb.expert_load_shares(op, Layout.parse("S0")))
    assert per_device == pytest.approx((3 / 14, 2 / 14, 2 / 14, 7 / 14)), per_device
    force = Restrictions(force={p: "S0" for p in _expert_params(graph)}, two_level=False)
    uniform, loaded = (make_plan(g, cluster, ratios=ratios, progress=False, restrictions=force, with_baselines=False)
                       for g in (graph, skewed))
    assert loaded.graph.expert_loads and loaded.predicted.step_time_s > uniform.predicted.step_time_s


def test_expert_loads_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`hetsynth plan --expert-loads` takes numbers or a JSON file; a count that does not match
    the experts is `error:`, exit 2, nothing written."""
    out = tmp_path / "plan.json"
    args = ["plan", "--model", TINY, "--cluster", str(CLUSTER), "-o", str(out), "--no-cache",
            "--ratios", "0.4,0.3,0.2,0.1"]  # one search, no LP rounds: the loads are what is tested
    assert main([*args, "--expert-loads", "1,2,3"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "3 numbers for 8 experts" in err and not out.exists(), err
    loads = tmp_path / "loads.json"
    loads.write_text(json.dumps([1, 1, 1, 1, 1, 1, 1, 5]))
    assert main([*args, "--expert-loads", str(loads)]) == 0
    assert list(hetsynth.load_plan(out).graph.expert_loads.values())[0][-1] == pytest.approx(5 / 12)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("experts "))
    assert "8 experts split" in line and "expected share of the routed pairs" in line, line


def test_micro_batch_graphs_keep_the_expert_loads() -> None:
    """A pipeline's micro-batch graphs (captured again at their size) carry the full graph's
    expert loads, so that stage plans are priced with them too (the router's auxiliary loss
    couples micro-batches: a model with it is pipelined with one micro-batch)."""
    from hetsynth.instruction_set.models import parse_model_ref
    from hetsynth.planner.microbatch import micro_graphs

    ref = "hf:mixtral,experts=routed,num_layers=1,num_local_experts=8,ffn_hidden=64,batch_size=4"
    full = with_expert_loads(capture_model(ref), [1] * 7 + [9])
    graphs, _ = micro_graphs(parse_model_ref(ref), full, [2, 2])
    assert graphs[2].expert_loads == full.expert_loads


def test_experts_dispatched_inside_nodes_work_on_their_nodes_tokens() -> None:
    """Tokens split over all devices, experts split inside each node (R|S0): a device computes
    its experts' pairs of its own node's tokens, its node's share of the tokens times its
    share of the experts; and the rule charges its two all-to-alls."""
    graph = capture_model(TINY)
    op = next(n for n in graph.calls if n.target == OP)
    pb = problem.Problem(graph, load_cluster(CLUSTER), [0.4, 0.3, 0.2, 0.1])
    rule = next(r for r in pb.rules[op.name] if r.local == "experts_dispatched" and r.inputs[3].is_two_level
                and r.inputs[0].outer.is_shard)
    node_tokens = pb.shares(op.inputs[0], Layout(rule.inputs[0].outer, Replicate()))
    experts = pb.shares(op.inputs[3], rule.inputs[3])
    assert pb.rule_shares(op, rule) == pytest.approx(tuple(t * e for t, e in zip(node_tokens, experts)))
    assert sum(pb.devices.expand(pb.rule_shares(op, rule))) == pytest.approx(1.0)
    cost, at, axis = pb.op_communication(op, rule)
    assert axis == "inner" and cost.at(at) > 0

