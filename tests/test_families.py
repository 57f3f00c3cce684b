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
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.instruction_set.graph import ReferenceGraph
from hetsynth.instruction_set.layouts import Shard
from hetsynth.instruction_set.mesh import Mesh
from hetsynth.planner.capture import summarize
from hetsynth.planner.planner import make_plan
from hetsynth.planner.problem import Restrictions
from hetsynth.runtime.check import check_on_pool, tensor_difference
from hetsynth.runtime.config import TrainConfig

# multi-process or seconds long: make test runs them, make test-fast does not
pytestmark = pytest.mark.slow

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
    plan = make_plan(graph, load_cluster(CLUSTER).first(4), ratios=RATIOS, progress=False, with_baselines=False)
    assert plan.mesh == Mesh(2, 2, True) and plan.model.dtype == "float32"
    float32, float64 = check_on_pool(pools.get(4), plan, CONFIG)
    assert float64.ok, float64.describe()
    assert float32.ok, float32.describe()  # information in the CLI; a gross error here is a bug
    if ref == "hf:llama":
        attention = [i for i in plan.instructions if i.kind == "compute" and "scaled_dot" in i.node]
        assert attention and any(n.target == "aten.scaled_dot_product_attention.default" for n in graph.calls)


def test_batchnorm_running_statistics_match_single_device(pools) -> None:
    """The ResNet's BatchNorm buffers after 3 steps with every BatchNorm split by batch (its
    statistics Partial, all-reduced, SyncBatchNorm-style: at this size the planner itself
    prefers other layouts), float64."""
    from hetsynth.runtime.check import pool_worker
    from hetsynth.runtime.rank_state import assemble
    from hetsynth.runtime.train import plan_reference

    ref = "resnet:tiny,dtype=float64"
    graph = hetsynth.capture_model(ref)
    stats = [n.name for n in graph.calls if n.target == "aten.mean.dim" and ".bn" not in n.module_path
             and n.args[1] == [0, 2, 3]]
    plan = make_plan(graph, load_cluster(CLUSTER).first(4), ratios=RATIOS, progress=False, with_baselines=False,
                     restrictions=Restrictions(force={n: "P" for n in stats}))
    batch_split = [i for i in plan.instructions if i.kind == "compute" and i.node in stats]
    assert len(batch_split) == len(stats) >= 10 and all(i.inputs[0].outer is Shard(0) for i in batch_split)
    assert any(i.kind == "all_reduce" and i.tensor in stats for i in plan.instructions)
    results = pools.get(4).run(pool_worker, plan, CONFIG, timeout_s=600)
    _, expected = plan_reference(plan, CONFIG)
    buffers = results[0][2]
    names = [k for k in buffers if k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert len(names) >= 3 * 5
    for name in names:
        assert tensor_difference(buffers[name], expected[name]) <= 1e-9, name
    tracked = [k for k in names if k.endswith("num_batches_tracked")]
    assert tracked and all(int(buffers[k]) == CONFIG.steps for k in tracked)
    params = assemble(plan, [r[1] for r in results])
    assert max(tensor_difference(v, expected[k]) for k, v in params.items()) <= 1e-8


def test_cli_inspect_plan_run_check(tmp_path: Path) -> None:
    """The same through the command line (nn.TransformerEncoder): no flags beyond the step
    count, a float32 plan, the float64 twin decides."""
    from test_launch import hetsynth_cli

    ref = "torch:transformer-encoder"
    out = hetsynth_cli("inspect", "--model", ref)
    assert out.returncode == 0 and "replicated fallback" not in out.stdout, out.stdout + out.stderr[-2000:]
    plan = str(tmp_path / "plan.json")
    out = hetsynth_cli("plan", "--model", ref, "--cluster", str(CLUSTER), "--devices", "4",
                       "--ratios", ",".join(map(str, RATIOS)), "-o", plan)
    assert out.returncode == 0, out.stderr[-2000:]
    out = hetsynth_cli("run", plan, "--steps", "3", "--check")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "check (information) float32" in out.stdout and "check: float64" in out.stdout and "OK" in out.stdout
    # the twin trains in the run's own launch (runtime.launch.twin_in_the_run), after the run's steps
    assert out.stdout.index("step    3/3") < out.stdout.index("rank 0 check: training the plan's float64 twin")
