"""A module that runs this rank's program of an SPMD plan, for the user's own training loop.

`ParallelModule(plan, groups, state, keys)` is what `hetsynth.parallelize` returns for SPMD
plans (FSDP2's design: the optimizer is the user's, untouched; the module's parameters are
what it updates, and gathering them is the module's business).

- `forward(*inputs)`: input i holds this rank's rows R_i of the global batch
  (runtime.input_rows); the program reads each layout's rows of them and returns this rank's
  summand l_r of the global loss, sum_r l_r = L(batch) (the plan's Partial loss).
- `parameters()` / `named_parameters()`: this rank's pieces under the module's own names: a
  sharded parameter's shard; under ZeRO-1/2 the rows leaf (runtime.zero) instead of the whole
  parameter; under ZeRO-3 the rows themselves. A standard `torch.optim` optimizer, with param
  groups and any lr_scheduler, is built on them.
- `loss.backward()`: the gradient buckets are all-reduced (or reduce-scattered) as the plan
  says, overlapped with the backward (runtime.grad_sync); at the end of the backward (an
  autograd engine callback) the buckets are waited, the forward's buffer updates written, and
  ZeRO leaves given their rows of the gradient. Under `no_sync()` the bucket hooks do nothing:
  gradients accumulate locally (a bucket's flat buffer holds the sum of the micro-steps) and
  the next synchronised backward reduces the sum, so sum_r sum_k g_{r,k} is what the optimizer
  sees either way (ZeRO-3 and SFB gradients are reduced in every backward: exact as well).
- A gradient cycle starts at the first forward with gradients enabled after a synchronised
  backward: the buckets are zeroed and every bucketed `.grad` is again a view of its bucket
  (`optimizer.zero_grad()` sets them to None). Gradients therefore never accumulate across
  optimizer steps, as in DDP.
- After `optimizer.step()` (a global optimizer step hook notices an optimizer that holds
  this module's parameters) the next forward, `state_dict()` or `clip_grad_norm_` first
  all-gathers the ZeRO-1/2 rows into the whole parameters (runtime.zero.after_step).
- `clip_grad_norm_(max_norm)`: global L2 norm over the whole model, every element once
  (runtime.rank_state.clip_norm), scale min(1, max_norm / (norm + 1e-6)) as torch's.
- Precision (runtime.mixed_precision): the forward runs under the autocast of this rank's
  device kind's compute dtype in the plan's policy; the parameters the optimizer holds stay
  float32. `scaler` is the run's loss scaler (torch's ShardedGradScaler over every rank,
  disabled unless some kind computes in float16), used as torch's AMP recipe uses a
  GradScaler: `scaler.scale(loss).backward()`, `scaler.unscale_(opt)` before clipping,
  `scaler.step(opt)`, `scaler.update()`.
- `global_loss(loss)`: the all-reduced sum of the ranks' summands, a float, the same on
  every rank. `state_dict()`: whole tensors under the plain module's state-dict keys (tied
  names included, non-persistent buffers not); `load_state_dict` slices them back.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from hetsynth.instruction_set.plan import Plan
from hetsynth.instruction_set.shards import MeshLayout
from hetsynth.runtime.codegen import RankProgram, build_rank_program, local_slice
from hetsynth.runtime.groups import Groups
from hetsynth.runtime.input_rows import check_rows, input_names, input_rows, layout_rows, local_rows
from hetsynth.runtime.mixed_precision import autocast, forward_dtype, loss_scaler
from hetsynth.runtime.rank_state import assemble, clip_norm, counts_once, gradient_sync, precision, stored_buffers
from hetsynth.runtime.zero import ZeroState


@dataclass(frozen=True)
class Piece:
    """A rank's piece of a parameter: the tensor the optimizer holds (its shape is the piece's
    size), its offset in the whole tensor per dim, the whole shape, and whether this rank
    writes it (the first replica; ZeRO rows: every rank its own)."""
    tensor: nn.Parameter
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    owner: bool


class _EndOfBackward(torch.autograd.Function):
    """Identity on the loss whose backward, the first of the pass, arms the module's
    end-of-backward callback (the engine runs queued callbacks when the pass is done)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, owner: "ParallelModule", synced: bool) -> torch.Tensor:
        ctx.owner, ctx.synced = owner, synced
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        ctx.owner._backward_started(ctx.synced)
        return grad, None, None


class PlannedModule(nn.Module):
    """What the modules of every plan shape share: the global loss and the plain module's
    state dict (`keys`: its state-dict key -> the plan's name; `whole_state()` and
    `_load_keys()` are the shape's own)."""

    keys: dict[str, str]
    synced: bool   # False inside no_sync()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes (pipelines: train steps) inside skip the gradient sync: gradients
        accumulate locally for the next synchronised one (accumulation micro-steps)."""
        previous = self.synced
        vars(self)["synced"] = False
        try:
            yield
        finally:
            vars(self)["synced"] = previous

    def _world_group(self) -> Any:
        raise NotImplementedError

    def whole_state(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
        raise NotImplementedError

    def _load_keys(self, by_key: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def global_loss(self, loss: torch.Tensor) -> float:
        """The sum of every rank's `loss` (their summands of the global loss), on every rank."""
        total = loss.detach().to(torch.float64).clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self._world_group())
        return float(total)

    def state_dict(self, *args: Any, rank0_only: bool = False, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The plain module's state dict (its keys, whole tensors); with rank0_only, {} on the
        other ranks. Collective: every rank calls it."""
        whole = self.whole_state(rank0_only=rank0_only)
        if whole is None:
            return {}
        return {key: whole[source] for key, source in self.keys.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Whole tensors under the plain module's keys, sliced into this rank's pieces."""
        missing = [k for k in self.keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in self.keys]
        if strict and (missing or unexpected):
            raise ValueError(f"state dict does not match the module: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self._load_keys({k: v for k, v in state_dict.items() if k in self.keys})
        return nn.modules.module._IncompatibleKeys(missing, unexpected)


class ParallelModule(PlannedModule):
    """This rank's program of an SPMD plan (module docstring)."""

    def __init__(self, plan: Plan, groups: Groups, state: Mapping[str, torch.Tensor], keys: Mapping[str, str],
                 device: torch.device, dtype: str | None = None) -> None:
        super().__init__()
        program = build_rank_program(plan, groups, state=state, device=device)
        sync = gradient_sync(plan, program, groups)
        zero = ZeroState.build(program.module, plan, groups, sync)
        read = {n.fqn for n in plan.graph.nodes if n.op == "buffer" and n.value is None}
        params = {p.fqn for p in program.params}
        unread = {k: v.detach().clone() for k, v in state.items() if k not in params and k not in read}
        vars(self).update(plan=plan, groups=groups, program=program, sync=sync, zero=zero, keys=dict(keys),
                          device=device, dtype=dtype, unread=unread, pending=None, stale=False,
                          new_cycle=True, synced=True, rows=input_rows(plan, groups.rank),
                          backward_done_s=0.0, bucket_timings=[],
                          scaler=loss_scaler(plan, device, groups.group("all"), dtype),
                          autocast_dtype=forward_dtype(plan, groups.rank, dtype))
        vars(self)["_reads"] = self._layout_positions()
        vars(self)["_leaf_ids"] = {id(p) for _, p in self.named_parameters()}
        ref = weakref.ref(self)
        vars(self)["_hook"] = register_optimizer_step_post_hook(
            lambda opt, *_: (m := ref()) is not None and m._on_optimizer_step(opt))

    def use_program(self, program: RankProgram) -> None:
        """Run `program`, a copy of this rank's program over the same parameters and buffers
        (runtime.timing's timed one), from the next forward on."""
        vars(self)["program"] = program

    # -- parameters -------------------------------------------------------------------------

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        module = self.program.module
        for p in self.program.params:
            param = getattr(module, p.name)
            yield prefix + p.fqn, (self.zero.leaf_of(param) if self.zero is not None else param)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if any(id(p) in self._leaf_ids for g in optimizer.param_groups for p in g["params"]):
            vars(self)["stale"] = True

    def local_pieces(self) -> dict[str, Piece]:
        """fqn -> this rank's piece of every parameter: what the optimizer holds, where it sits
        in the whole tensor, and whether this rank is the one that writes it (checkpoints)."""
        self.flush()
        module, rank = self.program.module, self.groups.rank
        rows = self.zero.state_rows() if self.zero is not None else {}
        out = {}
        for p in self.program.params:
            node = self.plan.graph.node(p.name)
            shape, offsets = tuple(node.out.shape), [0] * len(node.out.shape)
            if p.layout.is_shard:
                for dim, lengths in self.plan.lengths(p.name, p.layout).items():
                    offsets[dim] = MeshLayout(self.plan.mesh, p.layout).offset(lengths, dim, rank)
            owner = counts_once(self.groups, p.layout)
            if p.name in rows:  # ZeRO: this rank's rows, of a parameter whole on every rank
                offsets[0], owner = offsets[0] + rows[p.name][0], True
            param = getattr(module, p.name)
            out[p.fqn] = Piece(self.zero.leaf_of(param) if self.zero is not None else param, tuple(offsets), shape,
                               owner or p.name in rows)
        return out

    def pieces_written(self) -> None:
        """The pieces of local_pieces() were written in place (a checkpoint loaded): the next
        forward first gathers the ZeRO-1/2 rows into the whole parameters."""
        vars(self)["stale"] = True

    def whole_buffers(self) -> dict[str, torch.Tensor]:
        """The plain module's buffers by state-dict key, whole (replicated on every rank)."""
        by_fqn = self.unread | {fqn: b.detach() for fqn, b in stored_buffers(self.plan, self.program.module).items()}
        return {k: by_fqn[s] for k, s in self.keys.items() if s in by_fqn}

    def load_buffers(self, buffers: Mapping[str, torch.Tensor]) -> None:
        """Whole buffers by state-dict key (whole_buffers' form) into this rank's program."""
        self._load_whole({self.keys[k]: v for k, v in buffers.items() if k in self.keys})

    # -- forward ----------------------------------------------------------------------------

    def _layout_positions(self) -> list[tuple[int, slice | list[int]]]:
        """For each program input (tensor, layout): the forward argument and the positions of
        the layout's rows among this rank's rows of it."""
        names, batch, rank = input_names(self.plan), self.plan.model.batch_size, self.groups.rank
        out = []
        for tensor, layout in self.program.inputs:
            i = names.index(tensor)
            wanted = layout_rows(self.plan, self.plan.mesh, tensor, layout, rank, batch)
            out.append((i, local_rows(self.rows[i], wanted)))
        return out

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        check_rows(self.plan, self.rows, self.groups.rank, inputs)
        self.flush()
        grad = torch.is_grad_enabled()
        if grad and self.new_cycle:
            self._begin_cycle()
        args = [inputs[i][where].to(self.device) for i, where in self._reads]
        gathers = self.program.gathers
        with precision(self.dtype), autocast(self.autocast_dtype, self.device), \
                (gathers.releasing() if gathers is not None and grad else contextlib.nullcontext()):
            loss, *updates = self.program.module(*args)
        vars(self)["pending"] = list(updates)
        if not (grad and loss.requires_grad):
            self._write_buffers()
            return loss
        return _EndOfBackward.apply(loss, self, self.synced)

    # -- the gradient cycle -----------------------------------------------------------------

    def _begin_cycle(self) -> None:
        if self.sync is not None:
            self.sync.begin_step()
            self.sync.repoint()
        vars(self)["new_cycle"] = False

    def _backward_started(self, synced: bool) -> None:
        if self.sync is not None:
            self.sync.enabled = synced
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._backward_done(synced))

    def _backward_done(self, synced: bool) -> None:
        self._write_buffers()
        vars(self)["backward_done_s"] = time.perf_counter()  # what the buckets then leave is the sync's wait
        if not synced:
            return
        if self.sync is not None:
            vars(self)["bucket_timings"] = self.sync.finish()
        if self.zero is not None:
            self.zero.before_step()
        vars(self)["new_cycle"] = True

    def _write_buffers(self) -> None:
        if self.pending is None:
            return
        module = self.program.module
        with torch.no_grad():
            for name, value in zip(self.program.updates, self.pending, strict=True):
                getattr(module, name).copy_(value)
        vars(self)["pending"] = None

    def flush(self) -> None:
        """The forward's buffer updates of a pass without backward, and the ZeRO gather after
        an optimizer step."""
        self._write_buffers()
        if self.stale and self.zero is not None:
            self.zero.after_step()
        vars(self)["stale"] = False

    # -- the user's calls -------------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient by min(1, max_norm / (||g|| + 1e-6)); returns ||g|| (float64),
        the norm of the whole model's gradient, on every rank."""
        return torch.tensor(clip_norm(self.program, self.groups, self.zero, float(max_norm)), dtype=torch.float64)

    def _world_group(self) -> Any:
        return self.groups.group("all")

    def train_step(self, *inputs: torch.Tensor, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of this rank's rows, the backward of loss_scale * loss (times
        the loss scaler's scale when `scaler` is enabled); returns its loss summand (detached,
        not scaled), as a pipeline plan's train_step does, so one loop serves both."""
        loss = self(*inputs)
        self.scaler.scale(loss * loss_scale if loss_scale != 1.0 else loss).backward()
        return loss.detach()

    def whole_state(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
        """Every parameter and buffer whole, by the plan's names (collective)."""
        self.flush()
        module = self.program.module
        local = {p.fqn: (p.layout, getattr(module, p.name).detach().cpu()) for p in self.program.params}
        group = self.groups.group("all")
        world = dist.get_world_size(group)
        if rank0_only:
            gathered: list | None = [None] * world if self.groups.rank == 0 else None
            dist.gather_object(local, gathered, dst=0, group=group)
            if gathered is None:
                return None
        else:
            gathered = [None] * world
            dist.all_gather_object(gathered, local, group=group)
        stored = stored_buffers(self.plan, module)
        return assemble(self.plan, gathered) | {k: v.clone() for k, v in self.unread.items()} | {
            fqn: b.detach().cpu().clone() for fqn, b in stored.items()}

    def _load_keys(self, by_key: Mapping[str, torch.Tensor]) -> None:
        self.flush()
        self._load_whole({self.keys[k]: v for k, v in by_key.items()})

    def _load_whole(self, whole: Mapping[str, torch.Tensor]) -> None:
        module = self.program.module
        targets = self.unread | stored_buffers(self.plan, module)  # whole on this rank
        with torch.no_grad():
            for p in self.program.params:
                if p.fqn in whole:
                    getattr(module, p.name).copy_(self._piece(p.name, p.layout, whole[p.fqn]))
            for fqn, value in whole.items():
                if fqn in targets:
                    targets[fqn].copy_(value)

    def _piece(self, name: str, layout: Any, whole: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a whole parameter: its shard, or its ZeRO-3 rows."""
        part = local_slice(self.plan, name, layout, self.groups.rank, whole.detach().cpu())
        zero3 = self.zero.zero3() if self.zero is not None else set()
        if name in zero3:
            offset, rows = self.zero.state_rows()[name]
            part = part.narrow(0, offset, rows)
        return part


__all__ = ["ParallelModule", "Piece", "PlannedModule"]
