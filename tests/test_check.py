"""--check's comparison: dtype-aware tolerances, the worst tensor named, NaN fails; an op
without a float64 kernel runs in float32 inside the float64 twin, named, at float32's tolerance."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from hetsynth.instruction_set.precision import float_everywhere, lowered_ops_recorded
from hetsynth.runtime.check import compare, dtype_tolerances, tensor_difference

CLUSTER = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "local-emulated.toml"


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


# -- ops without a float64 kernel: run in float32 inside the float64 twin -------------------------

def float32_only() -> Any:
    """`hetsynth_check::float32_only(x, w) = x @ w`, a custom op whose kernel refuses float64
    (as torch._grouped_mm does), forward and backward; defined once per process."""
    try:
        return torch.ops.hetsynth_check.float32_only.default
    except (AttributeError, RuntimeError):
        pass

    @torch.library.custom_op("hetsynth_check::float32_only", mutates_args=())
    def op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64 or w.dtype == torch.float64:
            raise RuntimeError(f"Expected mat_a to be Float32, BFloat16 or Float16 matrix, got {x.dtype}")
        return x @ w

    op.register_fake(lambda x, w: x.new_empty(x.shape[0], w.shape[1]))
    op.register_autograd(lambda ctx, grad: (op(grad, ctx.w.t().contiguous()), op(ctx.x.t().contiguous(), grad)),
                         setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]) or
                         setattr(ctx, "w", inputs[1]))
    return torch.ops.hetsynth_check.float32_only.default


float32_only()  # at import, as a user's model file defines its ops: a rank resolves them by name


class Float32OnlyModel(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(hidden, hidden)
        self.w = torch.nn.Parameter(torch.randn(hidden, hidden) / hidden ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float32_only()(torch.tanh(self.inp(x)), self.w).pow(2).mean()


def float32_only_model(batch: int = 8, hidden: int = 8) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """The model reference `<this file>:float32_only_model` (instruction_set.models)."""
    torch.manual_seed(0)
    return Float32OnlyModel(hidden), (torch.randn(batch, hidden),)


def test_an_op_without_a_float64_kernel_runs_in_float32_and_is_named() -> None:
    op = float32_only()
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    with float_everywhere("float64"), lowered_ops_recorded() as lowered:
        y = op(x, w)
        y.pow(2).sum().backward()
        with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
            torch.mm(x, x)  # a real error is no missing kernel: it still raises
    assert y.dtype == torch.float64 and x.grad.dtype == torch.float64 and w.grad.dtype == torch.float64
    torch.testing.assert_close(y, x.detach() @ w.detach(), rtol=1e-6, atol=1e-6)
    assert lowered == {"hetsynth_check.float32_only.default": "float32"}
    with pytest.raises(RuntimeError, match="got torch.float64"):  # outside the twin: the op's own error
        op(x, w)


def test_lowered_ops_set_the_tolerance_and_are_named() -> None:
    lowered = {"aten._grouped_mm.default": "float32"}
    assert dtype_tolerances("float64", "adamw", 1e-3, 20, 1e-9, lowered) == dtype_tolerances(
        "float32", "adamw", 1e-3, 20, 1e-9)
    result = compare("float64", [2.0], [2.0 * (1 + 1e-6)], {}, {}, dtype_tolerances("float64", "sgd", 1e-3, 2, 1e-9,
                                                                                     lowered), lowered)
    assert result.ok and "aten._grouped_mm.default (float32)" in result.describe()
    assert "float32's" in result.describe()


def test_check_of_a_model_with_a_float32_only_op(pools) -> None:
    """`run --check`'s comparisons (on a pool of 2 ranks) for a model whose op refuses
    float64: the twin runs it in float32, the check names it and passes at float32's
    tolerance, no traceback."""
    from hetsynth.instruction_set.cluster import load_cluster
    from hetsynth.planner.planner import make_plan
    from hetsynth.runtime.check import check_on_pool
    from hetsynth.runtime.config import TrainConfig
    import hetsynth

    graph = hetsynth.capture_model(f"{Path(__file__).resolve()}:float32_only_model", allow_replicate_fallback=True)
    plan = make_plan(graph, load_cluster(CLUSTER).first(2), ratios=[0.75, 0.25], progress=False, with_baselines=False)
    float32, float64 = check_on_pool(pools.get(2), plan, TrainConfig(steps=2, lr=1e-2))
    assert float32.ok and not float32.lowered, float32.describe()
    assert float64.ok, float64.describe()
    assert dict(float64.lowered) == {"hetsynth_check.float32_only.default": "float32"}, float64.describe()
    assert float64.loss_tolerance > 1e-5


def test_a_dtype_mismatch_is_not_taken_for_a_missing_kernel() -> None:
    """mm of float64 by float32 fails for its inputs, not for want of a kernel: it raises, and a
    later twin still computes mm in float64 (a lowering found in one block stays in it)."""
    a, b = torch.randn(3, 3, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float32)
    with float_everywhere("float64"), lowered_ops_recorded() as lowered:
        with pytest.raises(RuntimeError):
            torch.mm(a, b)
        assert lowered == {}
    with float_everywhere("float64"):
        float32_only()(a, a)  # lowered inside this block only
    with float_everywhere("float64"), lowered_ops_recorded() as lowered:
        out = torch.mm(a, a)
    assert lowered == {} and out.dtype == torch.float64
    assert torch.equal(out, a @ a)
