"""ZeRO-1 and ZeRO-2 on one rank: the optimizer updates only this rank's rows of each parameter.

A ZeRO-1 parameter (instruction_set.training_state; rows per rank in the plan's
`state_shards`) stays whole in the module; its gradient is all-reduced whole as for any
replicated parameter (runtime.grad_sync). The optimizer holds, instead of the parameter,

    leaf = nn.Parameter(param.data.narrow(0, offset, rows))      a view: same storage

so the optimizer's state (AdamW's two moments) exists for this rank's rows only, and
`optimizer.step()` writes the updated rows into the module's parameter. Before the step the
leaf's gradient becomes the view `param.grad.narrow(0, offset, rows)` of the synchronised
gradient (clipping, which scales param.grad, scales it too); after the step one all-gather
of every rank's rows (flattened, rank-major: [rank 0: p1 rows | p2 rows | ...][rank 1: ...],
uneven lengths, the plan's variant: padded, grouped or ring, runtime.collectives.gather) and a
copy-out give every rank the whole updated parameters again. A rank with no rows holds an
empty leaf: AdamW steps empty tensors, and the all-gather handles zero-length shards.

A ZeRO-2 parameter's gradient never exists whole after the backward: its bucket
reduce-scatters it onto the rows (runtime.grad_sync, kind reduce_scatter), and the leaf's
gradient is this rank's rows of the sum (`GradientSync.row_grad`); the module's parameter has
no gradient. Clipping counts those rows on every rank (each rank holds distinct rows).

A ZeRO-3 parameter is its rows in the module already (runtime.zero3, runtime.codegen): its
leaf is the module's parameter, its gradient is on the rows (the gathers' reduce-scatters),
and there is nothing to gather after the step.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch
from torch import nn

from hetsynth.instruction_set.plan import Plan
from hetsynth.instruction_set.training_state import TrainingState
from hetsynth.runtime.collectives import COLLECTIVE_VARIANTS, Span
from hetsynth.runtime.grad_sync import GradientSync
from hetsynth.runtime.groups import Groups


@dataclass
class RowShard:
    name: str                 # the module attribute (the plan's tensor)
    param: nn.Parameter       # the whole parameter in the module
    leaf: nn.Parameter        # this rank's rows: what the optimizer holds
    rows: tuple[int, ...]     # every rank's rows
    state: TrainingState = TrainingState.ZERO1

    @property
    def grad_rows(self) -> bool:
        """ZeRO-2 and ZeRO-3: the gradient is held as the rows."""
        return self.state != TrainingState.ZERO1

    def offset(self, rank: int) -> int:
        return sum(self.rows[:rank])


class ZeroState:
    """The ZeRO-1 parameters of one rank (module docstring)."""

    def __init__(self, shards: list[RowShard], span: Span, variant: str, sync: GradientSync | None = None) -> None:
        self.shards, self.span, self.variant, self.sync = shards, span, variant, sync
        self.by_param = {id(s.param): s for s in shards}

    @staticmethod
    def build(module: nn.Module, plan: Plan, groups: Groups, sync: GradientSync | None = None) -> "ZeroState | None":
        """`sync`: the gradient buckets, which hold the ZeRO-2 parameters' rows of the gradient."""
        if plan.state_shards is None:
            return None
        rank = groups.rank
        states = {i.tensor: i.state for i in plan.instructions if i.kind == "param"}
        assert sync is not None or TrainingState.ZERO2 not in states.values(), "ZeRO-2 needs the gradient buckets"
        shards = []
        for name, rows in plan.state_shards.rows.items():
            param = getattr(module, name)
            if states[name] == TrainingState.ZERO3:  # the module holds the rows themselves
                shards.append(RowShard(name, param, param, rows, TrainingState.ZERO3))
                continue
            start = sum(rows[:rank])
            leaf = nn.Parameter(param.data.narrow(0, start, rows[rank]), requires_grad=param.requires_grad)
            shards.append(RowShard(name, param, leaf, rows, states[name]))
        return ZeroState(shards, groups.span("all"), plan.state_shards.variant, sync)

    def optimizer_params(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """The parameters to optimise: each ZeRO-1 parameter replaced by its rows' leaf."""
        return [self.by_param[id(p)].leaf if id(p) in self.by_param else p for p in params]

    def leaf_of(self, param: nn.Parameter) -> nn.Parameter:
        """What the optimizer holds for a module parameter (itself unless ZeRO-1)."""
        shard = self.by_param.get(id(param))
        return param if shard is None else shard.leaf

    def before_step(self) -> None:
        """Each leaf's gradient: its rows of the synchronised whole gradient (a view; ZeRO-2:
        the reduce-scattered rows)."""
        rank = self.span.index
        for s in self.shards:
            if s.state == TrainingState.ZERO3:  # autograd put the rows' gradient on the leaf itself
                continue
            if s.grad_rows:
                s.leaf.grad = self.sync.row_grad(s.param) if self.sync is not None else None
                continue
            g = s.param.grad
            s.leaf.grad = None if g is None else g.narrow(0, s.offset(rank), s.rows[rank])

    def row_grads(self) -> list[torch.Tensor]:
        """The ZeRO-2/3 leaves' gradients (this rank's rows; ZeRO-2's set by before_step)."""
        return [s.leaf.grad for s in self.shards if s.grad_rows and s.leaf.grad is not None]

    def leaves(self) -> list[nn.Parameter]:
        return [s.leaf for s in self.shards]

    def after_step(self) -> None:
        """All-gather every rank's updated rows and copy them into the whole parameters (ZeRO-1/2)."""
        whole = [s for s in self.shards if s.state != TrainingState.ZERO3]
        for dtype in dict.fromkeys(s.param.dtype for s in whole):
            self._gather([s for s in whole if s.param.dtype == dtype])
        for s in self.shards:
            s.leaf.grad = None

    def _gather(self, shards: list[RowShard]) -> None:
        rank, world = self.span.index, self.span.size
        row_numel = [s.param[0].numel() if s.param.dim() > 0 else 1 for s in shards]
        lengths = tuple(sum(s.rows[r] * n for s, n in zip(shards, row_numel)) for r in range(world))
        mine = [s.leaf.detach().reshape(-1) for s in shards]
        flat = torch.cat(mine) if mine else shards[0].param.new_empty(0)
        span = Span(self.span.group, self.span.members, rank, 0, lengths)
        with torch.no_grad():
            whole = COLLECTIVE_VARIANTS.get("all_gather", variant=self.variant)(flat, span)
            at = 0
            for r in range(world):
                for s, n in zip(shards, row_numel):
                    count = s.rows[r] * n
                    if count:
                        s.param.data.narrow(0, s.offset(r), s.rows[r]).copy_(
                            whole[at:at + count].view(s.rows[r], *s.param.shape[1:]))
                    at += count

    def zero3(self) -> set[str]:
        return {s.name for s in self.shards if s.state == TrainingState.ZERO3}

    def state_rows(self) -> dict[str, tuple[int, int]]:
        """name -> (offset, rows) of this rank's rows."""
        rank = self.span.index
        return {s.name: (s.offset(rank), s.rows[rank]) for s in self.shards}


__all__ = ["RowShard", "ZeroState"]
