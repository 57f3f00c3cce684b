"""Stage programs reused between stages of the same structure (planner.stage_reuse): equal
stage graphs and sub-clusters are recognised up to names, and the reused plan is the one the
synthesis gives that stage."""

from __future__ import annotations

from functools import lru_cache

from hetsynth.api import capture_model, load_cluster
from hetsynth.instruction_set.graph import ReferenceGraph
from hetsynth.instruction_set.mixed_precision import choose_policy
from hetsynth.instruction_set.stages import stage_graph
from hetsynth.planner.pipeline import _synthesized, block_starts, program_at
from hetsynth.planner.stage_reuse import StagePrograms, anonymous, structure

REF = "gpt:tiny,num_layers=6"


@lru_cache(maxsize=None)
def _graph() -> ReferenceGraph:
    return capture_model(REF)


def _stages() -> list[ReferenceGraph]:
    """Blocks 0-1 (with the embedding), 2-3, 4-5 (with the head) as stage graphs."""
    g = _graph()
    starts = block_starts(g)  # blocks 1..5 start here
    edges = [0, starts[1], starts[3], len(g.calls)]
    return [stage_graph(g, a, b) for a, b in zip(edges, edges[1:])]


def test_equal_stages_are_recognised_up_to_names() -> None:
    first, middle, last = _stages()
    g = _graph()
    starts = block_starts(g)
    other = stage_graph(g, starts[2], starts[4])  # blocks 2-3 -> 3-4: the same structure, other names
    assert structure(other) == structure(middle)
    assert {n.name for n in other.nodes} != {n.name for n in middle.nodes}
    assert structure(first) != structure(middle) != structure(last)
    spec = load_cluster("configs/clusters/hap-paper.toml")
    assert anonymous(spec.subset(range(16, 24))) == anonymous(spec.subset(range(24, 32)))  # two P100 nodes
    assert anonymous(spec.subset(range(0, 8))) != anonymous(spec.subset(range(16, 24)))  # V100 against P100


def test_a_reused_stage_plan_is_the_synthesized_one() -> None:
    g = _graph()
    starts = block_starts(g)
    spec = load_cluster("configs/clusters/hap-paper.toml")
    policy = choose_policy(spec, "fp32", "float32")
    a, b = stage_graph(g, starts[1], starts[3]), stage_graph(g, starts[3], starts[5])
    ca, cb = spec.subset(range(16, 24)), spec.subset(range(24, 32))
    programs = StagePrograms()
    made = [programs.plan(graph, c, ("options",), lambda graph=graph, c=c: _synthesized(graph, c, None, 32, policy),
                          program_at) for graph, c in ((a, ca), (b, cb))]
    assert programs.hits == 1
    direct = _synthesized(b, cb, None, 32, policy)
    reused = made[1]
    assert reused.instructions == direct.instructions
    assert reused.sharding_ratios == direct.sharding_ratios
    assert reused.predicted.step_time_s == direct.predicted.step_time_s
    assert reused.cluster == cb and reused.graph == b
    assert reused.shards == direct.shards
    # a different sub-cluster (V100s) is planned anew
    programs.plan(b, spec.subset(range(0, 8)), ("options",), lambda: _synthesized(b, spec.subset(range(0, 8)), None,
                                                                                  32, policy), program_at)
    assert programs.hits == 1
