"""Model families users bring: inspect -> plan (4 devices, uneven ratios) -> run --check, no flags.

Each model is built from its config (nothing downloaded), captured without the replicated
fallback, planned for the emulated cluster's four devices (a 2 x 2 two-level mesh) at ratios
0.4/0.3/0.2/0.1, then checked as `hetsynth run --check` does (runtime.check, here on a pool of
ranks): the float32 plan trained and compared with single-device training (information), and
its float64 twin compared at 1e-9 relative loss and 1e-8 for every parameter and buffer. The
families: HuggingFace Llama with grouped-query attention, a ResNet with BatchNorm in training
mode and `out += identity` (running statistics within 1e-9), torch's nn.TransformerEncoder
(batch_first), GPT with its tied embedding on the two-level mesh, and the zoo.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import hetsynth
from cost_models.cluster import load_cluster
from instruction_set.graph import ReferenceGraph
from planner.capture import summarize
from runtime.check import check_on_pool, tensor_difference
from runtime.train import TrainConfig

CLUSTER = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "local-emulated.toml"
RATIOS = [0.4, 0.3, 0.2, 0.1]
CONFIG = TrainConfig(steps=3, lr=1e-2)

FAMILIES = ["hf:llama", "resnet:tiny", "torch:transformer-encoder", "gpt:tiny", "bert:tiny", "vit:tiny",
            "vgg:tiny", "moe:tiny"]


def inspect(ref: str) -> ReferenceGraph:
    graph = hetsynth.capture_model(ref)
    summary = summarize(graph)
    assert summary["fallback_ops"] == {} and summary["num_ops"] > 0
    return graph


@pytest.mark.parametrize("ref", FAMILIES)
def test_family_plans_and_trains_exactly(pools, ref: str) -> None:
    graph = inspect(ref)
    plan = hetsynth.plan(ref, cluster=load_cluster(CLUSTER), num_devices=4, ratios=RATIOS)
    assert plan.mesh == (2, 2) and plan.model.dtype == "float32"
    float32, float64 = check_on_pool(pools.get(4), plan, CONFIG)
    assert float64.ok, float64.describe()
    assert float32.ok, float32.describe()  # information in the CLI; a gross error here is a bug
    if ref == "hf:llama":
        attention = [i for i in plan.instructions if i.kind == "compute" and "scaled_dot" in i.node]
        assert attention and any(n.target == "aten.scaled_dot_product_attention.default" for n in graph.calls)


def test_batchnorm_running_statistics_match_single_device(pools) -> None:
    """The ResNet's BatchNorm buffers after 3 steps under a data-parallel plan (batch-split
    statistics all-reduced, SyncBatchNorm-style), float64."""
    from runtime.check import pool_worker
    from runtime.train import assemble, plan_reference

    plan = hetsynth.plan("resnet:tiny,dtype=float64", cluster=load_cluster(CLUSTER), num_devices=4,
                         ratios=RATIOS, data_parallel=True)
    batch_split_norm = [i for i in plan.instructions if i.kind == "compute" and "mean_dim" in i.node
                        and i.inputs[0].startswith("S0")]
    assert batch_split_norm, "expected batch-split BatchNorm statistics"
    results = pools.get(4).run(pool_worker, plan, CONFIG, timeout_s=600)
    _, expected = plan_reference(plan, CONFIG)
    buffers = results[0][2]
    stats = [k for k in buffers if k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert len(stats) >= 3 * 5
    for name in stats:
        assert tensor_difference(buffers[name], expected[name]) <= 1e-9, name
    tracked = [k for k in stats if k.endswith("num_batches_tracked")]
    assert tracked and all(int(buffers[k]) == CONFIG.steps for k in tracked)
    params = assemble(plan, [r[1] for r in results])
    assert max(tensor_difference(v, expected[k]) for k, v in params.items()) <= 1e-8
