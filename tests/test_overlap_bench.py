"""bench/overlap.py's statistics (no measurement): the exposed fraction's bootstrap interval."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import overlap  # noqa: E402


def _samples(matmul: list[float], comm: float, fused_extra: float) -> dict[str, list[float]]:
    return {"matmul": matmul, "unfused": [m + comm for m in matmul], "fused": [m + fused_extra for m in matmul]}


def test_a_steady_matmul_gives_a_narrow_interval_around_the_exposure() -> None:
    matmul = [1.0 + 0.001 * (k % 3) for k in range(15)]
    lo, hi = overlap.exposure_interval(_samples(matmul, 0.2, 0.02))
    assert 0.09 < lo <= hi < 0.11


def test_a_matmul_that_moves_by_repetition_widens_it() -> None:
    """The same exposure (0.1) under a matmul whose time moves by 25% from one repetition to
    the next, the fused and unfused times drawn from other repetitions' speed."""
    speed = [1.0, 1.25, 1.0, 1.1, 1.25, 1.0, 1.2, 1.0, 1.25, 1.05, 1.0, 1.15, 1.25, 1.0, 1.1]
    samples = {"matmul": speed, "unfused": [s + 0.2 for s in speed[5:] + speed[:5]],
               "fused": [s + 0.02 for s in speed[10:] + speed[:10]]}
    lo, hi = overlap.exposure_interval(samples)
    assert hi - lo > 0.15


class _NoModel:
    def step_ratio(self, case: dict) -> float:
        return 0.0


def test_every_environment_has_both_kinds_at_four_sizes_each_with_its_repetitions() -> None:
    for env in overlap.REGIMES:
        cases = overlap.cases(env, _NoModel())
        assert len({c["name"] for c in cases}) == len(cases) == 2 * 4 * 2
        assert {c["kind"] for c in cases} == {"ag_matmul", "matmul_rs"}
        assert all(c["reps"] >= 15 and sum(c["lengths"]) == overlap.REGIMES[env][0] for c in cases)
