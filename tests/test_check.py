"""--check's comparison: dtype-aware tolerances, the worst tensor named, NaN fails."""

from __future__ import annotations

import math

import torch

from runtime.check import compare, dtype_tolerances, tensor_difference


def test_tolerances_by_dtype() -> None:
    assert dtype_tolerances("float64", "adamw", 1e-3, 20, 1e-9) == (1e-9, 1e-8)
    loss, params = dtype_tolerances("float32", "adamw", 1e-3, 20, 1e-9)
    assert 3e-4 < loss < 4e-4 and abs(params - (loss + 0.04)) < 1e-12
    assert dtype_tolerances("float32", "sgd", 1e-3, 20, 1e-9)[1] == loss


def test_difference_is_absolute_for_small_values_relative_for_large() -> None:
    small = tensor_difference(torch.tensor([0.5], dtype=torch.float64), torch.tensor([0.5 + 1e-9], dtype=torch.float64))
    assert abs(small - 1e-9) < 1e-15
    assert abs(tensor_difference(torch.tensor([1000.0], dtype=torch.float64),
                                 torch.tensor([1000.001], dtype=torch.float64)) - 1e-6) < 1e-9
    assert math.isnan(tensor_difference(torch.tensor([math.nan]), torch.tensor([0.0])))
    assert tensor_difference(torch.zeros(2), torch.zeros(3)) == math.inf


def test_compare_names_the_worst_parameter_or_buffer() -> None:
    want = {"w": torch.zeros(3, dtype=torch.float64), "bn.running_var": torch.ones(2, dtype=torch.float64),
            "alias.w": torch.zeros(3, dtype=torch.float64)}
    got = {"w": torch.tensor([0.0, 1e-10, 0.0], dtype=torch.float64),
           "bn.running_var": torch.tensor([1.0, 1.0 + 3e-8], dtype=torch.float64)}
    result = compare("float64", [2.0, 1.5], [2.0, 1.5 + 1e-12], got, want, (1e-9, 1e-8))
    assert not result.ok and result.worst == "bn.running_var" and 2e-8 < result.worst_diff < 4e-8
    assert "bn.running_var" in result.describe()
    got["bn.running_var"] = want["bn.running_var"].clone()
    assert compare("float64", [2.0], [2.0], got, want, (1e-9, 1e-8)).ok
    got["w"] = torch.tensor([math.nan, 0.0, 0.0], dtype=torch.float64)
    bad = compare("float64", [2.0], [2.0], got, want, (1e-9, 1e-8))
    assert not bad.ok and bad.worst == "w" and bad.worst_diff == math.inf
    assert not compare("float64", [math.nan], [2.0], {}, {}, (1e-9, 1e-8)).ok
