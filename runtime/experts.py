"""The routed-experts op with tokens and experts both split, on a rank (local `experts_dispatched`,
instruction_set.rules.moe): an nn.Module of the generated program that runs
instruction_set.experts_op.dispatched_math with this rank's expert range and the group's
row exchange (runtime.collectives.alltoall.RowExchange).

Why a module and not a local rewrite (instruction_set.local): the op exchanges rows between the
ranks of a group, which the single-process rewrites cannot, and the counts it exchanges are
known only when the batch's routing is."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from hetsynth.instruction_set.experts_op import dispatched_math
from hetsynth.runtime.collectives.alltoall import RowExchange
from hetsynth.runtime.collectives.span import Span


def expert_starts(lengths: Sequence[int]) -> tuple[int, ...]:
    """Each member's first expert, then the number of experts: (0, l_0, l_0 + l_1, ..., E)."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return tuple(out)


class DispatchedExperts(nn.Module):
    """out = the op's rows of this rank's tokens, its experts' terms computed where they live."""

    def __init__(self, span: Span, act: str, device: torch.device) -> None:
        super().__init__()
        self.starts, self.member, self.act = expert_starts(span.lengths), span.index, act
        self.exchange = RowExchange(span.group, span.size, device)
        self.description = f"experts {self.starts[self.member]}..{self.starts[self.member + 1] - 1} of " \
                           f"{self.starts[-1]} on member {self.member} of {span.size}, starts {list(self.starts)}"

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
        return dispatched_math(x, idx, w, gate_up, down, self.act, self.starts, self.member, self.exchange)

    def extra_repr(self) -> str:
        return self.description
