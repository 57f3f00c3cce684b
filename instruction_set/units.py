"""Bounded magnitudes of the cluster spec, with their units in the names (FLOP/s, GiB, GB/s,
Gbit/s, microseconds): finite values far outside any device (1e308 GiB, 1e-300 FLOP/s) would
make the planner's products overflow to inf or its quotients vanish inside the solvers, so a
spec is refused with the range instead."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field


def within(low: float, high: float, unit: str) -> AfterValidator:
    """A validator accepting None or a value in [low, high] `unit`."""
    def check(value: float | None) -> float | None:
        if value is not None and not low <= value <= high:
            raise ValueError(f"must be in [{low:g}, {high:g}] {unit}")
        return value
    return AfterValidator(check)


Flops = Annotated[float, Field(gt=0), within(1e3, 1e21, "FLOP/s")]
GiB = Annotated[float, Field(gt=0), within(1e-6, 1e6, "GiB")]
GByteS = Annotated[float, Field(gt=0), within(1e-6, 1e7, "GB/s")]
Gbps = Annotated[float, Field(gt=0), within(1e-6, 1e7, "Gbit/s")]
Micros = Annotated[float, Field(ge=0), within(0, 1e8, "us")]
