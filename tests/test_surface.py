"""The op surface is bounded and covered: every op a lowered graph can hold has a sharding
rule, a reason to be replicated-only, a decomposition, or a reason it cannot occur."""

from __future__ import annotations

import torch

from hetsynth.instruction_set.interpret import resolve_target
from hetsynth.instruction_set.rules import is_supported, registered_targets
from hetsynth.instruction_set.rules.surface import classify, core_ops
from hetsynth.planner.lower import KEEP, decomposition_table


def test_every_op_of_the_surface_is_classified() -> None:
    ops = core_ops() + [str(op) for op in KEEP] + ["aten.copy_.default"]
    assert len(ops) > 150
    unclassified = [op for op in ops if not classify(op)]
    assert unclassified == []


def test_pointwise_ops_share_one_rule_and_in_place_ops_are_outside() -> None:
    for op in ("aten.atan2.default", "aten.logical_xor.default", "aten.hardsigmoid.default"):
        assert torch.Tag.pointwise in resolve_target(op).tags and op not in registered_targets()
        assert is_supported(op), op
    assert not is_supported("aten.add_.Tensor") and not is_supported("aten.relu_.default")


def test_kept_composites_are_not_decomposed() -> None:
    table = decomposition_table()
    assert all(op not in table for op in KEEP)
    assert torch.ops.aten.matmul.default in table and torch.ops.aten.conv2d.default in table
