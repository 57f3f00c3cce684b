"""Codegen handles every layout the rules produce on every two-level mesh we ship.

Each zoo tiny model (GPT and BERT with their tied embedding / output weight) is planned for
every shipped cluster whose devices form a two-level mesh, and every rank's generated program
runs one forward and backward pass: on the `fake` process group in this process (collectives
move no data, so this checks the programs, their shapes and every collective call, not the
numbers): every rank of a mesh of up to 8 ranks; on larger meshes every rank of the first and
last node and the first rank of every other node (ranks differ only in their shard lengths and
offsets). The tied GPT weight is also forced into the layouts
that once crashed code generation (vocabulary split inside each node, the decomposed
cross-entropy's gather reading a two-level `S0|S1` tensor); on the emulated cluster's 2 x 2
mesh that plan trains for real and matches single-device training in float64.
"""

from __future__ import annotations

import datetime

import functools
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg as fake_pg

from hetsynth import capture_model
from hetsynth.instruction_set.cluster import ClusterSpec, load_cluster
from hetsynth.instruction_set.graph import ReferenceGraph
from hetsynth.instruction_set.layouts import Shard
from hetsynth.instruction_set.mesh import Mesh
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.instruction_set.plan import Plan
from hetsynth.planner import baselines
from hetsynth.planner.planner import make_plan
from hetsynth.planner.problem import Restrictions
from hetsynth.runtime.codegen import build_rank_program
from hetsynth.runtime.groups import Groups
from hetsynth.runtime.train import full_state, rank_rows
from test_parity import check, nodes

CLUSTERS = Path(__file__).resolve().parents[1] / "configs" / "clusters"
ZOO = ["gpt", "bert", "vit", "vgg", "moe"]


def two_level_clusters() -> list[str]:
    out = []
    for path in sorted(CLUSTERS.glob("*.toml")):
        spec = load_cluster(path)
        if Mesh.of([len(n.devices) for n in spec.nodes]).two_level:
            out.append(path.stem)
    return out


TWO_LEVEL = two_level_clusters()


def sample_ranks(mesh: Mesh) -> list[int]:
    if mesh.size <= 8:
        return list(range(mesh.size))
    last = mesh.num_nodes - 1
    return sorted(set(mesh.node_ranks(0)) | set(mesh.node_ranks(last)) | set(mesh.cross_ranks(0)))


def dry_run(plan: Plan) -> None:
    """The sampled ranks' programs, forward and backward, on the fake process group."""
    spec = parse_model_ref(plan.model.ref)
    state = full_state(spec, seed=0)
    batch = spec.batch_size
    world = plan.cluster.num_devices
    for rank in sample_ranks(plan.mesh):
        dist.init_process_group("fake", rank=rank, world_size=world, store=fake_pg.FakeStore())
        try:
            groups = Groups.create(plan.mesh, rank, world=dist.group.WORLD,
                                   timeout=datetime.timedelta(seconds=60))  # the fake group has no options
            program = build_rank_program(plan, groups, state=state)
            names = [n.name for n in plan.graph.nodes if n.op == "input"]
            inputs = [spec.make_batch(list(rank_rows(plan, name, layout, rank, batch)), seed=1)[names.index(name)]
                      for name, layout in program.inputs]
            loss, *updates = program.module(*inputs)
            loss.backward()
            assert loss.dim() == 0 and len(updates) == len(program.updates)
            for p in program.module.parameters():
                assert p.grad is None or p.grad.shape == p.shape
        finally:
            dist.destroy_process_group()


@functools.cache
def _capture(ref: str) -> ReferenceGraph:
    return capture_model(ref)


def _plan(ref: str, cluster: ClusterSpec, restrictions: Restrictions | None = None) -> Plan:
    """The search's plan at throughput-proportional ratios (a narrow search without the
    baseline seeds, to keep the test cheap)."""
    return make_plan(_capture(ref), cluster, ratios=baselines.proportional(cluster), width=4,
                     progress=False, with_baselines=False, restrictions=restrictions or Restrictions())


def test_shipped_two_level_meshes_are_covered() -> None:
    assert {"local-emulated", "a100-t4", "hap-paper"} <= set(TWO_LEVEL)


@pytest.mark.parametrize("cluster", TWO_LEVEL)
@pytest.mark.parametrize("model", ZOO)
@pytest.mark.slow
def test_planned_programs_run_on_every_rank(cluster: str, model: str) -> None:
    dry_run(_plan(f"{model}:tiny", load_cluster(CLUSTERS / f"{cluster}.toml")))


def vocab_parallel_inside(graph: ReferenceGraph) -> dict:
    """The tied output projection split over the vocabulary inside each node and by batch
    across nodes; the loss's gather reads the logits in S0|S1 (the layout that crashed)."""
    lm_head = nodes(graph, "aten.linear.default")[-1]
    gather = nodes(graph, "aten.gather.default")[0]
    return {lm_head: "S0|S2", gather: "S0|P"}


def _tied_plan(cluster: ClusterSpec) -> Plan:
    ref = "gpt:tiny,dtype=float64"
    plan = _plan(ref, cluster, Restrictions(force=vocab_parallel_inside(_capture(ref))))
    gather = next(i for i in plan.instructions if i.kind == "compute" and "gather" in i.node)
    x = gather.inputs[0]
    assert x.outer is Shard(0) and x.inner.is_shard and x.is_two_level and gather.local == "gather_sharded", gather
    return plan


@pytest.mark.parametrize("cluster", TWO_LEVEL)
@pytest.mark.slow
def test_tied_weight_split_inside_nodes_runs(cluster: str) -> None:
    dry_run(_tied_plan(load_cluster(CLUSTERS / f"{cluster}.toml")))


def test_tied_weight_split_inside_nodes_matches_single_device(pools) -> None:
    check(pools, _tied_plan(load_cluster(CLUSTERS / "local-emulated.toml")))
