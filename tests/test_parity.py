"""Distributed training matches single-device training (gloo, world sizes 2 and 4, float64).

Every zoo model's tiny preset trains 5 steps with AdamW (and global-norm clipping) under plans
with uneven ratios, with a zero-length shard, and with forced layouts that exercise
column- and row-parallel linears, head-parallel attention, the vocab-parallel loss,
channel-parallel convolutions, expert parallelism, two-level (across / inside node) layouts and
every collective variant. The global loss of every step must match within 1e-9 relative and
the reassembled parameters within 1e-8.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hetsynth import capture_model
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.instruction_set.graph import ReferenceGraph
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.instruction_set.plan import Plan
from hetsynth.planner.planner import DP_SEED, make_plan
from hetsynth.instruction_set.layouts import S
from hetsynth.planner.problem import Restrictions, StorageClass
from hetsynth.runtime.config import TrainConfig
from hetsynth.runtime.rank_state import assemble
from hetsynth.runtime.train import reference_training

CLUSTER = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "local-emulated.toml"
CONFIG = TrainConfig(steps=5, optimizer="adamw", lr=1e-2, max_grad_norm=1.0)


def train_worker(rank: int, world: int, plan: Plan, config: TrainConfig) -> tuple:
    import torch.distributed as dist
    from hetsynth.runtime.groups import Groups
    from hetsynth.runtime.train import local_parameters, setup, train_step

    trainer = setup(plan, Groups.create(plan.mesh, rank, world=dist.group.WORLD), config)
    losses = [train_step(trainer, step).loss for step in range(config.steps)]
    return losses, local_parameters(trainer)


def make(ref: str, ratios: list[float], restrictions: Restrictions | None = None) -> Plan:
    cluster = load_cluster(CLUSTER).first(len(ratios))
    return make_plan(capture_model(ref), cluster, ratios=ratios, progress=False,
                     restrictions=restrictions, with_baselines=False)


def check(pools, plan: Plan) -> None:
    check_results(plan, pools.get(plan.cluster.num_devices).run(train_worker, plan, CONFIG, timeout_s=600))


def check_results(plan: Plan, results: list) -> None:
    """Every rank's (losses, local parameters, ...) of CONFIG's training against one device's:
    losses within 1e-9 relative, the assembled parameters within 1e-8."""
    spec = parse_model_ref(plan.model.ref)
    expected_losses, expected = reference_training(spec, spec.batch_size, CONFIG)
    for step, (got, want) in enumerate(zip(results[0][0], expected_losses)):
        assert abs(got - want) <= 1e-9 * abs(want), f"step {step}: loss {got} != {want}"
    params = assemble(plan, [r[1] for r in results])
    for name, value in params.items():
        err = float((value - expected[name]).abs().max()) if value.numel() else 0.0
        assert err <= 1e-8, f"{name}: max difference {err}"


def nodes(graph: ReferenceGraph, target: str, module: str = "") -> list[str]:
    return [n.name for n in graph.calls if n.target == target and module in n.module_path]


ZOO = ["gpt", "bert", "vit", "vgg", "moe"]


@pytest.mark.parametrize("model", ZOO)
@pytest.mark.parametrize("ratios", [[0.55, 0.45], [0.4, 0.3, 0.2, 0.1]])
def test_planned_uneven(pools, model: str, ratios: list[float]) -> None:
    check(pools, make(f"{model}:tiny,dtype=float64", ratios))


@pytest.mark.parametrize("model,ratios", [("gpt", [0.6, 0.4, 0.0, 0.0]), ("vit", [0.5, 0.0, 0.3, 0.2]),
                                          ("moe", [0.0, 0.7, 0.3, 0.0]), ("bert", [0.0, 0.6, 0.4]),
                                          ("vgg", [0.7, 0.0])])
def test_zero_length_shard(pools, model: str, ratios: list[float]) -> None:
    plan = make(f"{model}:tiny,dtype=float64", ratios)
    assert any(0 in lengths for t in plan.shards.values() for dims in t.values() for lengths in dims.values())
    check(pools, plan)


def test_sgd(pools) -> None:
    global CONFIG
    saved, CONFIG = CONFIG, TrainConfig(steps=5, optimizer="sgd", lr=0.1, max_grad_norm=None)
    try:
        check(pools, make("bert:tiny,dtype=float64", [0.4, 0.3, 0.2, 0.1]))
    finally:
        CONFIG = saved


def _gpt(ratios: list[float], **restrict) -> Plan:
    ref = "gpt:tiny,dtype=float64"
    graph = capture_model(ref)
    force = restrict.pop("force_fn")(graph) if "force_fn" in restrict else {}
    return make(ref, ratios, Restrictions(force=force, **restrict))


def tensor_parallel_mlp(graph: ReferenceGraph, fc1: str = "S2", fc2: str = "P") -> dict:
    force = {}
    for name in nodes(graph, "aten.linear.default", "ffn.fc1"):
        force[name] = fc1      # column-parallel: weight split on its output features
    for name in nodes(graph, "aten.linear.default", "ffn.fc2"):
        force[name] = fc2      # row-parallel: input split on features, output Partial
    return force


@pytest.mark.parametrize("ratios", [[0.55, 0.45], [0.4, 0.3, 0.2, 0.1]])
def test_column_and_row_parallel_linear(pools, ratios: list[float]) -> None:
    plan = _gpt(ratios, force_fn=tensor_parallel_mlp)
    kinds = {(i.kind, str(i.layout)) for i in plan.instructions}
    assert ("compute", "S2") in kinds and ("compute", "P") in kinds
    check(pools, plan)


@pytest.mark.parametrize("variant", ["padded", "grouped", "ring"])
def test_collective_variants(pools, variant: str) -> None:
    """Tensor-parallel MLP with activations gathered and Partial sums reduce-scattered."""
    force = lambda g: tensor_parallel_mlp(g) | {n: "S0" for n in nodes(g, "aten.add.Tensor", "blocks")}
    plan = _gpt([0.5, 0.3, 0.2, 0.0], force_fn=force, two_level=False, allow_fusion=False,
                variants={"all_gather": (variant,), "reduce_scatter": (variant,)})
    used = {(i.kind, i.variant) for i in plan.instructions}
    assert ("reduce_scatter", variant) in used or ("all_gather", variant) in used, used
    check(pools, plan)


def test_head_parallel_attention(pools) -> None:
    force = lambda g: {n: "S1" for n in nodes(g, "aten.scaled_dot_product_attention.default")}
    plan = _gpt([0.55, 0.45], force_fn=force)
    assert any(i.kind == "compute" and i.layout is S(1) and "attention" in i.node for i in plan.instructions)
    check(pools, plan)


def test_vocab_parallel_loss(pools) -> None:
    """The tied output projection split over the vocabulary, the loss computed vocab-parallel
    (max and sum-of-exp all-reduced, the target logit gathered where it lives)."""
    def force(g: ReferenceGraph) -> dict:
        lm_head = nodes(g, "aten.linear.default")[-1]
        return {lm_head: "S2", nodes(g, "aten.amax.default")[0]: "Pmax",
                nodes(g, "aten.gather.default")[0]: "P", "p_tok_weight": "S0"}
    plan = _gpt([0.4, 0.3, 0.2, 0.1], force_fn=force, two_level=False)
    kinds = [i.kind for i in plan.instructions]
    assert "all_reduce_max" in kinds and any(i.local == "gather_sharded" for i in plan.instructions)
    check(pools, plan)


def test_channel_parallel_conv(pools) -> None:
    ref = "vgg:tiny,dtype=float64"
    graph = capture_model(ref)
    convs = nodes(graph, "aten.convolution.default")
    force = {convs[-1]: "S1", convs[-2]: "P"}   # output-channel split, then input-channel split
    plan = make(ref, [0.6, 0.4], Restrictions(force=force))
    check(pools, plan)


def test_expert_parallel_moe(pools) -> None:
    ref = "moe:tiny,dtype=float64"
    graph = capture_model(ref)
    einsum = lambda eq: [n.name for n in graph.calls if n.target == "aten.einsum.default" and n.args[0] == eq]
    force = {e: "S0" for e in einsum("egcm,emf->egcf")}          # experts split over devices
    force |= {d: "S1" for d in einsum("gsec,gsm->egcm")}         # dispatch stays split by group
    plan = make(ref, [0.4, 0.3, 0.2, 0.1], Restrictions(force=force, two_level=False))
    assert any(i.kind == "all_to_all" for i in plan.instructions)
    check(pools, plan)


def test_two_level_layouts(pools) -> None:
    """Data parallel across the two emulated nodes, tensor parallel inside each node."""
    force = lambda g: tensor_parallel_mlp(g, fc1="S0|S2", fc2="S0|P")
    plan = _gpt([0.4, 0.3, 0.2, 0.1], force_fn=force)
    axes = {i.axis for i in plan.instructions}
    assert "inner" in axes, axes
    check(pools, plan)


def test_hierarchical_all_reduce(pools) -> None:
    plan = _gpt([0.4, 0.3, 0.2, 0.1], force_fn=lambda g: tensor_parallel_mlp(g, fc2="P"),
                variants={"all_reduce": ("hierarchical",)},
                param_layouts=frozenset({StorageClass.SHARDED}))
    assert any(i.kind == "all_reduce" and i.variant == "hierarchical" for i in plan.instructions)
    check(pools, plan)


@pytest.mark.parametrize("model,ratios,variant", [("vgg", [0.55, 0.45], "padded"),
                                                  ("vgg", [0.5, 0.3, 0.2, 0.0], "grouped"),
                                                  ("gpt", [0.4, 0.3, 0.2, 0.1], "ring")])
def test_sufficient_factor_broadcasting(pools, model: str, ratios: list[float], variant: str) -> None:
    """Data parallelism with every applicable weight synchronised by SFB (factors gathered
    with one variant, a zero-length shard among them), biases all-reduced as usual."""
    ref = f"{model}:tiny,dtype=float64"
    force = {n: "S0" for n in nodes(capture_model(ref), "aten.linear.default", "blocks")}
    plan = make(ref, ratios, dataclasses.replace(DP_SEED, force_sfb=True, force=force,
                                                 variants={"all_gather": (variant,)}))
    sfb = [i for i in plan.instructions if i.kind == "sfb"]
    assert sfb and all(i.variant == variant for i in sfb), [i.describe() for i in plan.instructions]
    check(pools, plan)
