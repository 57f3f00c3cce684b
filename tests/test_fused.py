"""CommFuse on real gloo process groups (world sizes 2, 3, 4; one pool call per world size,
every case inside it): the fused rings and the k-slice baseline (runtime.collectives.fused)
equal the unfused pair in float64, for even, uneven and zero-length chunks (first, middle,
last, all but one)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from runtime.collectives.fused import ag_matmul_ring, ag_matmul_sliced, matmul_rs_ring, matmul_rs_sliced
from runtime.collectives.span import Span

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
    for run in (lambda f: ag_matmul_ring(x, span, f), lambda f: ag_matmul_sliced(x, span, f, 2),
                lambda f: ag_matmul_sliced(x, span, f, 4)):
        chunks, x_full = run(lambda j, rows: rows @ w.t())
        errs += [err(torch.cat(chunks), full @ w.t()), err(x_full, full)]
    mine = _rand(10 + rank, sum(lengths), 5)
    expected = sum(_rand(10 + r, sum(lengths), 5) @ w.t() for r in range(world))
    expected = expected.narrow(0, span.offset(rank), lengths[rank])
    errs.append(err(matmul_rs_ring(span, lambda j: mine.narrow(0, span.offset(j), lengths[j]) @ w.t()), expected))
    for k in (2, 4):
        got = matmul_rs_sliced(span, lambda j, s, n: mine.narrow(0, span.offset(j) + s, n) @ w.t(), k)
        errs.append(err(got, expected))
    return max(errs)


def kernel_cases(rank: int, world: int) -> list[float]:
    return [kernel_case(rank, world, lengths) for lengths in LENGTHS[world]]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fused_kernels_equal_the_unfused_pair(pools, world: int) -> None:
    per_rank = pools.get(world).run(kernel_cases)
    for i, lengths in enumerate(LENGTHS[world]):
        assert max(r[i] for r in per_rank) < 1e-12, lengths
