"""Activation recomputation (instruction_set.blocks, runtime.recompute): plans whose blocks are
recomputed train exactly as single-device training (float64, uneven ratios, a zero-length
shard, tensor-parallel blocks whose collectives run again in the backward)."""

from __future__ import annotations

import dataclasses

import pytest

from hetsynth.instruction_set.blocks import mark_recomputed, recompute_units, recomputed_units
from hetsynth.trace import predicted_step
from hetsynth.planner.planner import DP_SEED, make_plan
from hetsynth.planner.problem import Problem
from hetsynth.planner.step_cost import predict_program
from test_parity import _gpt, check, make, tensor_parallel_mlp

# multi-process or seconds long: make test runs them, make test-fast does not
pytestmark = pytest.mark.slow


def recomputed(plan):
    units = recompute_units(plan.graph, plan.instructions)
    assert units, "the plan has blocks to recompute"
    return plan.model_copy(update={"instructions": mark_recomputed(plan.instructions, units)})


@pytest.mark.parametrize("ref, ratios", [("gpt:tiny,dtype=float64", [0.7, 0.3]),
                                         ("bert:tiny,dtype=float64", [0.5, 0.3, 0.2, 0.0])])
def test_recomputed_blocks_match_single_device(pools, ref: str, ratios: list[float]) -> None:
    plan = recomputed(make(ref, ratios))
    assert len(recomputed_units(plan.instructions)) == 2
    check(pools, plan)


def test_recomputed_tensor_parallel_blocks(pools) -> None:
    plan = recomputed(_gpt([0.55, 0.45], force_fn=tensor_parallel_mlp, allow_fusion=False))  # fused: not recomputed
    assert any(i.recompute and i.kind in ("all_reduce", "reduce_scatter", "all_gather") for i in plan.instructions)
    check(pools, plan)


def test_planner_recomputes_when_memory_is_tight(pools) -> None:
    """A cluster whose memory holds the best plan only with its blocks recomputed: the planner
    recomputes them, the prediction charges their forward again, and the plan trains as
    single-device training."""
    plain = make("gpt:tiny,dtype=float64", [0.7, 0.3], DP_SEED)  # data parallel: recomputation is the way to fit
    low, high = peak_gib(recomputed(plain)), peak_gib(plain)
    assert low < high
    kinds = {k: v.model_copy(update={"memory_gib": (low + high) / 2}) for k, v in plain.cluster.device_kinds.items()}
    cluster = plain.cluster.model_copy(update={"device_kinds": kinds})
    plan = make_plan(plain.graph, cluster, ratios=[0.7, 0.3], progress=False, with_baselines=False,
                     restrictions=dataclasses.replace(DP_SEED, allow_zero=False))  # (ZeRO-1: tests/test_zero.py)
    assert plan.predicted.fits and recomputed_units(plan.instructions)
    assert plan.predicted.step_time_s > plain.predicted.step_time_s
    predicted_step(plan)  # the trace lays the recomputation out as the prediction does (it checks the totals)
    check(pools, plan)


def test_units_are_the_repeated_blocks() -> None:
    gpt = make("gpt:tiny", [0.5, 0.5])
    assert [u.name for u in recompute_units(gpt.graph, gpt.instructions)] == ["blocks.0", "blocks.1"]
    vgg = make("vgg:tiny", [0.5, 0.5])
    assert recompute_units(vgg.graph, vgg.instructions) == []  # single layers: nothing to gain


def peak_gib(plan) -> float:
    prediction, _ = predict_program(Problem(plan.graph, plan.cluster, plan.sharding_ratios), plan.instructions)
    return max(d.memory_gib for d in prediction.devices)


def test_fused_linear_after_a_recomputed_block(pools) -> None:
    """bert:tiny's layer 1 attention column-parallel on the batch-split output of layer 0
    (post-LN: the query linear reads layer 0's last layer norm), fused (ag_matmul), and layer
    0 recomputed: the fused instruction reads the gathered value in its `src` layout
    (instruction_set.blocks.reads, shared by the planner and the runtime), so the recomputed
    body returns it, and the plan trains as one device does."""
    from hetsynth import capture_model
    from hetsynth.instruction_set.blocks import reads, writes
    from hetsynth.planner.problem import Restrictions
    from hetsynth.runtime.recompute import read_after
    from test_fused_parity import _linears, _split_input

    ref = "bert:tiny,batch_size=12,dtype=float64"
    graph = capture_model(ref)
    force = _linears(graph, "layers.1.attn", "S2") | _split_input(graph, "layers.1.attn.query")
    plan = make(ref, [0.55, 0.45], Restrictions(force=force, two_level=False, force_fusion=True))
    first = recompute_units(plan.graph, plan.instructions)[0]
    plan = plan.model_copy(update={"instructions": mark_recomputed(plan.instructions, [first])})
    fused = next(i for i in plan.instructions[first.last:] if i.kind == "ag_matmul")
    x = plan.graph.node(fused.node).inputs[0]
    assert reads(plan.graph, fused)[0] == (x, fused.src)
    assert (x, fused.inputs[0]) in writes(plan.graph, fused)       # the gathered input, for later readers
    assert (x, fused.src) in read_after(plan.graph, plan.instructions, first.last)
    assert any(i.recompute and i.runs_op and i.tensor == x for i in plan.instructions)  # defined in the body
    check(pools, plan)
