"""CommFuse on real gloo process groups (world sizes 2, 3, 4; one pool call per world size,
every case inside it): the fused rings and the k-slice baseline (runtime.collectives.fused)
and the autograd functions with fused adjoints (runtime.fused_ops: forward and backward)
equal the unfused pair in float64, for even, uneven and zero-length chunks (first, middle,
last, all but one)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed as dist

from hetsynth.runtime.collectives.fused import ag_matmul_ring, ag_matmul_sliced, matmul_rs_ring, matmul_rs_sliced
from hetsynth.runtime.collectives.span import Span
from hetsynth.runtime.fused_ops import AGLinear, LinearRS

if TYPE_CHECKING:
    from hetsynth.instruction_set.plan import Plan

sys.path.insert(0, str(Path(__file__).resolve().parent))

LENGTHS = {2: [(3, 2), (0, 4), (5, 0), (1, 1)],
           3: [(2, 0, 3), (0, 0, 5), (1, 2, 3), (7, 1, 0), (2, 2, 2)],
           4: [(2, 1, 0, 3), (0, 0, 0, 5), (1, 1, 1, 1), (3, 0, 2, 0)]}


def _rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max()) if a.numel() else 0.0


def kernel_case(rank: int, world: int, lengths: tuple[int, ...]) -> float:
    """Largest error of every kernel against the unfused result."""
    span = Span(dist.group.WORLD, tuple(range(world)), rank, 0, lengths)
    full, w = _rand(0, sum(lengths), 5), _rand(1, 3, 5)
    x = full.narrow(0, span.offset(rank), lengths[rank])
    errs = []
    for run in (lambda f, y: ag_matmul_ring(x, span, f, y), lambda f, y: ag_matmul_sliced(x, span, f, 2, y),
                lambda f, y: ag_matmul_sliced(x, span, f, 4, y)):
        y = torch.full((sum(lengths), 3), float("nan"), dtype=torch.float64)  # every row must be written
        x_full = run(lambda j, start, rows, out: torch.mm(rows, w.t(), out=out), y)
        errs += [err(y, full @ w.t()), err(x_full, full)]
    mine = _rand(10 + rank, sum(lengths), 5)
    expected = sum(_rand(10 + r, sum(lengths), 5) @ w.t() for r in range(world))
    expected = expected.narrow(0, span.offset(rank), lengths[rank])
    errs.append(err(matmul_rs_ring(span, lambda j: mine.narrow(0, span.offset(j), lengths[j]) @ w.t()), expected))
    for k in (2, 4):
        got = matmul_rs_sliced(span, lambda j, s, n: mine.narrow(0, span.offset(j) + s, n) @ w.t(), k)
        errs.append(err(got, expected))
    return max(errs)


def ag_linear_case(rank: int, world: int, lengths: tuple[int, ...], variant: str) -> float:
    """AGLinear on x (2, T, 4) split along dim 1, forward and backward, against the unfused
    pair computed whole; every rank's gradients of y and x_full differ (x_full's readers)."""
    span = Span(dist.group.WORLD, tuple(range(world)), rank, 1, lengths)
    full, w, b = _rand(0, 2, sum(lengths), 4), _rand(1, 3, 4), _rand(2, 3)
    x = full.narrow(1, span.offset(rank), lengths[rank]).clone().requires_grad_()
    wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
    y, x_full = AGLinear.apply(x, wl, bl, span, variant)
    gy = [_rand(10 + r, 2, sum(lengths), 3) for r in range(world)]
    gx = [_rand(20 + r, *full.shape) for r in range(world)]
    ((y * gy[rank]).sum() + (x_full * gx[rank]).sum()).backward()
    dx = sum(g @ w + h for g, h in zip(gy, gx)).narrow(1, span.offset(rank), lengths[rank])
    return max(err(y, torch.nn.functional.linear(full, w, b)), err(x_full, full), err(x.grad, dx),
               err(wl.grad, gy[rank].reshape(-1, 3).t() @ full.reshape(-1, 4)),
               err(bl.grad, gy[rank].reshape(-1, 3).sum(0)))


def linear_rs_case(rank: int, world: int, lengths: tuple[int, ...], variant: str) -> float:
    """LinearRS: every rank's x (2, T, 4) and W (3, 4) summed, scattered along dim 1 (+ b)."""
    span = Span(dist.group.WORLD, tuple(range(world)), rank, 1, lengths)
    xs, ws = [_rand(30 + r, 2, sum(lengths), 4) for r in range(world)], [_rand(40 + r, 3, 4) for r in range(world)]
    b = _rand(2, 3)
    x, w, bl = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_(), b.clone().requires_grad_()
    y = LinearRS.apply(x, w, bl, span, variant)
    whole = sum(a @ c.t() for a, c in zip(xs, ws)) + b
    grad = _rand(50, *whole.shape)  # the gradient of the whole y; each rank holds its rows
    mine = lambda t: t.narrow(1, span.offset(rank), lengths[rank])
    (y * mine(grad)).sum().backward()
    return max(err(y, mine(whole)), err(x.grad, grad @ ws[rank]),
               err(w.grad, grad.reshape(-1, 3).t() @ xs[rank].reshape(-1, 4)),
               err(bl.grad, mine(grad).reshape(-1, 3).sum(0)))


def all_cases(rank: int, world: int) -> list[float]:
    out = [kernel_case(rank, world, lengths) for lengths in LENGTHS[world]]
    for variant in ("ring", "sliced2", "sliced4"):
        out += [max(ag_linear_case(rank, world, lengths, variant), linear_rs_case(rank, world, lengths, variant))
                for lengths in LENGTHS[world]]
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fused_kernels_and_autograd_equal_the_unfused_pair(pools, world: int) -> None:
    """Each case's largest error over ranks: kernels, then AGLinear/LinearRS per variant."""
    per_rank = pools.get(world).run(all_cases)
    names = [f"kernels {l}" for l in LENGTHS[world]] + [f"{v} {l}" for v in ("ring", "sliced2", "sliced4")
                                                         for l in LENGTHS[world]]
    for i, name in enumerate(names):
        assert max(r[i] for r in per_rank) < 1e-12, name


# -- inside plans: the zoo's tiny models trained 5 AdamW steps in float64 (tests/test_parity.py) --

def _tp_plan(ref: str, ratios: list[float], **restrict: object) -> "Plan":
    """Megatron-style tensor-parallel MLPs with the residual stream split by batch: every fc1
    reads an all-gathered activation, every fc2's Partial is reduce-scattered; fusion forced."""
    from test_parity import make, nodes
    from hetsynth import capture_model
    from hetsynth.planner.problem import Restrictions

    graph = capture_model(ref)
    force = {n: "S2" for n in nodes(graph, "aten.linear.default", "fc1")}
    force |= {n: "P" for n in nodes(graph, "aten.linear.default", "fc2")}
    force |= {n: "S0" for n in nodes(graph, "aten.add.Tensor", "blocks")}
    return make(ref, ratios, Restrictions(force=force, two_level=False, force_fusion=True, **restrict))


PLANS = [("gpt", [0.55, 0.45], {}), ("gpt", [0.5, 0.0, 0.5], {"variants": {"ag_matmul": ("sliced2",),
                                                                           "matmul_rs": ("sliced4",)}}),
         ("gpt", [0.5, 0.3, 0.2, 0.0], {})]


@pytest.mark.parametrize("model,ratios,restrict", PLANS)
def test_fused_instructions_in_plans_train_like_one_device(pools, model, ratios, restrict) -> None:
    from test_parity import check
    from hetsynth.planner.planner import without_fusion

    plan = _tp_plan(f"{model}:tiny,dtype=float64", ratios, **restrict)
    fused = [i for i in plan.instructions if i.kind in ("ag_matmul", "matmul_rs")]
    assert {i.kind for i in fused} == {"ag_matmul", "matmul_rs"}, [i.describe() for i in plan.instructions]
    assert not any(i.kind in ("all_gather", "reduce_scatter") and i.tensor in {f.tensor for f in fused}
                   for i in plan.instructions)
    for ins in fused:
        assert set(ins.alternatives) >= {"unfused", ins.variant}
    plain = without_fusion(plan)
    assert not any(i.kind in ("ag_matmul", "matmul_rs") for i in plain.instructions)
    assert len(plain.instructions) == len(plan.instructions) + len(fused)
    check(pools, plan)
