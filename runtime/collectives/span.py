"""What a collective needs to know about its group and the shard lengths along one dim."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Span:
    """A group (explicit process group handle), its members' global ranks, my index among
    them, the split dim and every member's length along it (lengths may be 0)."""

    group: Any
    members: tuple[int, ...]
    index: int
    dim: int
    lengths: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def my_length(self) -> int:
        return self.lengths[self.index]

    def offset(self, member: int) -> int:
        return sum(self.lengths[:member])

    @property
    def offsets(self) -> tuple[int, ...]:
        """Every member's first row: offset(j) for j in order."""
        return tuple(self.offset(j) for j in range(self.size))

    def describe(self) -> str:
        return f"dim={self.dim}, lengths={list(self.lengths)}"


def to_front(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.movedim(dim, 0).contiguous()


def from_front(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.movedim(0, dim).contiguous()


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Pad dim 0 with zeros up to `rows`."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])], dim=0)
