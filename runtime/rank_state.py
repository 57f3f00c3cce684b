"""What a rank's share of a plan's state needs, whichever loop drives it (runtime.parallel's
module for a user's loop, runtime.train's recipe for `hetsynth run`, checks and checkpoints):

- whole tensors from every rank's pieces (assemble: a shard's offset along a dim is the sum
  of the lengths before it; ZeRO-3 rows in rank order);
- the global gradient norm ||g|| = sqrt(sum_r sum_{x in counted_r} x^2), every element of the
  whole model counted once (a replicated copy only on the first rank of its replica group), and
  clipping by min(1, max_norm / (||g|| + 1e-6)) as torch.nn.utils.clip_grad_norm_;
- the plan's gradient buckets over a rank's program; the buffers the program stores;
- the float dtype of a plan's twin (instruction_set.precision) around a pass.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import torch.distributed as dist

from hetsynth.instruction_set.layouts import Layout
from hetsynth.instruction_set.plan import Plan
from hetsynth.instruction_set.precision import float_everywhere
from hetsynth.instruction_set.shards import MeshLayout
from hetsynth.instruction_set.training_state import TrainingState
from hetsynth.runtime.codegen import RankProgram
from hetsynth.runtime.grad_sync import GradientSync
from hetsynth.runtime.groups import Groups
from hetsynth.runtime.mixed_precision import gradient_wire
from hetsynth.runtime.zero import ZeroState


def gradient_sync(plan: Plan, program: RankProgram, groups: Groups) -> GradientSync | None:
    """The plan's gradient buckets over a rank's program (None when no parameter needs a sync)."""
    buckets = plan.buckets()
    rows = plan.state_shards.rows if plan.state_shards is not None else None
    return GradientSync.build(program.module, buckets, groups, rows, gradient_wire(plan)) if buckets else None


def counts_once(groups: Groups, layout: Layout) -> bool:
    """Whether this rank's copy of a parameter counts in global sums (first replica)."""
    return MeshLayout(groups.mesh, layout).counts_once(groups.rank)


def clip_norm(program: RankProgram, groups: Groups, zero: ZeroState | None, max_norm: float) -> float:
    """Scale every gradient by max_norm / (||g|| + 1e-6) when that is below 1; returns ||g||.
    A ZeRO-2 gradient is held as rows (runtime.zero): each rank counts its own rows."""
    module = program.module
    zero3 = zero.zero3() if zero is not None else set()
    params = [(p, getattr(module, p.name).grad) for p in program.params if p.name not in zero3]
    rows = zero.row_grads() if zero is not None else []
    replicated = not rows and not any(p.layout.is_shard for p, _ in params)  # every rank holds every gradient
    counted = [g for p, g in params if g is not None and (replicated or counts_once(groups, p.layout))]
    counted += rows
    total = squared_norm(counted)
    if not replicated:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=groups.group("all"))
    norm = float(total.sqrt())
    scale = max_norm / (norm + 1e-6)
    grads = [p.grad for n, p in module.named_parameters() if p.grad is not None and n not in zero3] + rows
    scale_grads(grads, scale)
    return norm


def squared_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """sum_x x^2 over the elements of `grads`, in float64 (one foreach norm per tensor)."""
    norms = torch._foreach_norm(list(grads), 2.0, dtype=torch.float64) if grads else []
    return torch.stack(norms).pow(2).sum() if norms else torch.zeros((), dtype=torch.float64)


def scale_grads(grads: Sequence[torch.Tensor], scale: float) -> None:
    """Multiply every gradient by `scale` where that shrinks them (clipping never grows them)."""
    if scale < 1.0 and grads:
        torch._foreach_mul_(list(grads), scale)


def precision(dtype: str | None) -> contextlib.AbstractContextManager:
    """Twins in another dtype compute everything in it (instruction_set.precision)."""
    return float_everywhere(dtype) if dtype is not None else contextlib.nullcontext()


def stored_buffers(plan: Plan, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """fqn -> the program's own tensor of every buffer the graph reads (stored R: whole on
    every rank, updated by training)."""
    return {node.fqn: getattr(module, node.name) for node in plan.graph.nodes
            if node.op == "buffer" and node.value is None and hasattr(module, node.name)}


def assemble(plan: Plan, per_rank: Sequence[dict[str, tuple[Layout, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Whole parameters from every rank's slices (replicated copies must agree)."""
    mesh = plan.mesh
    by_fqn = {n.fqn: n for n in plan.graph.params}
    zero3 = {i.tensor for i in plan.instructions if i.kind == "param" and i.state == TrainingState.ZERO3}
    out = {}
    for fqn, (layout, _) in per_rank[0].items():
        node = by_fqn[fqn]
        if node.name in zero3:  # every rank's rows, in rank order
            out[fqn] = torch.cat([params[fqn][1] for params in per_rank])
            continue
        full = torch.full(node.out.shape, float("nan"), dtype=per_rank[0][fqn][1].dtype)
        for rank, params in enumerate(per_rank):
            index = [slice(None)] * full.dim()
            if layout.is_shard:
                for dim, lengths in plan.lengths(node.name, layout).items():
                    start = MeshLayout(mesh, layout).offset(lengths, dim, rank)
                    index[dim] = slice(start, start + lengths[rank])
            full[tuple(index)] = params[fqn][1]
        out[fqn] = full
    return out


__all__ = ["assemble", "clip_norm", "counts_once", "gradient_sync", "precision", "stored_buffers"]
