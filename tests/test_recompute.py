"""Activation recomputation (instruction_set.blocks, runtime.recompute): plans whose blocks are
recomputed train exactly as single-device training (float64, uneven ratios, a zero-length
shard, tensor-parallel blocks whose collectives run again in the backward)."""

from __future__ import annotations

import pytest

from instruction_set.blocks import mark_recomputed, recompute_units, recomputed_units
from test_parity import _gpt, check, make, tensor_parallel_mlp


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
    plan = recomputed(_gpt([0.55, 0.45], force_fn=tensor_parallel_mlp))
    assert any(i.recompute and i.kind in ("all_reduce", "reduce_scatter", "all_gather") for i in plan.instructions)
    check(pools, plan)
