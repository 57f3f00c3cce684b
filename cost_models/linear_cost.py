"""The one shape every cost takes: per-device affine in the device's share.

An instruction's time on device i is `a_i + b_i * s_i`, where `s_i` is the fraction of the
sharded dim that device i holds (0 <= s_i <= 1, sum_i s_i = 1); replicated work has b = 0.
Instructions are bulk-synchronous, so the instruction takes

    cost(s) = max_i (a_i + b_i * s_i)

The search and the plan evaluate it at the rounded shares of a shard-length vector; the
sharding-ratio LP evaluates it at the ratios themselves through one epigraph variable per
distinct (a, b) (planner.ratios). Memory is the same form without the max, per device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class LinearCost:
    a: tuple[float, ...]
    b: tuple[float, ...]

    @staticmethod
    def constant(value: float, n: int) -> "LinearCost":
        return LinearCost((value,) * n, (0.0,) * n)

    @staticmethod
    def work(fixed: Sequence[float], work: Sequence[float], *, sharded: bool) -> "LinearCost":
        """Per-device `fixed` time plus `work` done on the device's share when `sharded`, in
        full by every device otherwise."""
        if sharded:
            return LinearCost(tuple(fixed), tuple(work))
        return LinearCost(tuple(f + w for f, w in zip(fixed, work)), (0.0,) * len(fixed))

    @staticmethod
    def zero(n: int) -> "LinearCost":
        return LinearCost((0.0,) * n, (0.0,) * n)

    def per_device(self, shares: Sequence[float]) -> list[float]:
        return [a + b * s for a, b, s in zip(self.a, self.b, shares)]

    def at(self, shares: Sequence[float]) -> float:
        """max_i a_i + b_i s_i (written out: max() over a generator costs a third more here)."""
        best = None
        for a, b, s in zip(self.a, self.b, shares):
            value = a + b * s
            if best is None or value > best:
                best = value
        if best is None:
            raise ValueError("a cost of no devices has no time")
        return best

    def __add__(self, other: "LinearCost") -> "LinearCost":
        return LinearCost(tuple(x + y for x, y in zip(self.a, other.a)),
                          tuple(x + y for x, y in zip(self.b, other.b)))

    def scaled(self, factor: float) -> "LinearCost":
        return LinearCost(tuple(x * factor for x in self.a), tuple(x * factor for x in self.b))

    @property
    def is_constant(self) -> bool:
        return not any(self.b)
