"""Measured communication parameters written by the profiler.

The alpha-beta model charges a message of `b` bytes `alpha + b / beta`. The profiler fits
alpha (latency, us) and beta (bandwidth, Gbit/s) per link class ("intra" for devices of one
node, "inter" for groups of all devices across nodes, "outer" for the concurrent groups of one
device per node, which share each node's NIC) and per collective variant (for example "all_gather.ring"), by
least squares over message sizes (profiling.profiler). Variants without a fit fall back to the
link figures of the cluster spec.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class AlphaBeta(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    latency_us: float = Field(ge=0)
    bandwidth_gbps: float = Field(gt=0)

    def seconds(self, num_bytes: float) -> float:
        """alpha + bytes / beta, in seconds."""
        return self.latency_us * 1e-6 + num_bytes * 8 / (self.bandwidth_gbps * 1e9)


class Calibration(BaseModel):
    """Per variant and link class alpha-beta fits: collectives["all_gather.ring"]["inter"]."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    collectives: dict[str, dict[str, AlphaBeta]] = Field(default_factory=dict)
    source: str = ""

    def lookup(self, variant: str, link_class: str) -> AlphaBeta | None:
        return self.collectives.get(variant, {}).get(link_class)
