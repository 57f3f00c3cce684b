"""A module that runs this rank's stage of a pipeline plan, for the user's own training loop.

`PipelineModule(plan, rank, state, keys, device)` is what `hetsynth.parallelize` returns for
pipeline plans: runtime.parallel.ParallelModule's face, on the executor `hetsynth run` uses
(runtime.pipeline.trainer: one code path for both).

- `train_step(*inputs)`: input i holds this rank's rows R_i of the global batch
  (runtime.input_rows: every micro-batch's rows of its stage's layouts, the whole batch for
  inputs of batch statistics, none for inputs the stage never reads). It runs the plan's
  schedule, the forward and backward of every micro-batch with the boundary transfers, so
  autograd accumulates sum_m g_m into `.grad`; then the stage's replicated gradients are
  all-reduced on their axis and the copies of a parameter several stages hold (a tied
  embedding) summed over their holders (trainer.sync_gradients). It returns this rank's
  summand l_r of the batch's loss (float64, detached; sum_r l_r = L(batch): the last stage's
  Partial loss, zero elsewhere). A pipeline cannot split forward from backward: `forward`
  with gradients enabled is an error; under torch.no_grad it is an evaluation pass (the
  forward actions only) returning l_r.
- `no_sync()`: train steps inside skip the sync; gradients accumulate locally and the next
  synchronised step reduces their sum, which is exact (the syncs are linear).
- `parameters()` / `named_parameters()`: this rank's stage's pieces (shards, or whole
  replicated parameters) under the module's own names, for a standard `torch.optim`.
- `clip_grad_norm_(max_norm)`: the global L2 norm, each element counted once (the first
  replica in the first stage holding it), scale min(1, max_norm / (norm + 1e-6)) as torch's.
- `global_loss`, `state_dict(rank0_only=...)`, `load_state_dict`, `local_pieces`,
  `whole_buffers`, `load_buffers`: ParallelModule's semantics. A stage holds only its own
  buffers' live values, so `state_dict` and `whole_buffers` are collective (every rank calls).
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from hetsynth.instruction_set.plan import Plan
from hetsynth.instruction_set.shards import MeshLayout
from hetsynth.runtime.codegen import local_slice
from hetsynth.runtime.input_rows import check_rows
from hetsynth.runtime.parallel import Piece, PlannedModule
from hetsynth.runtime.pipeline.checkpoint import whole_buffers as merge_buffers
from hetsynth.runtime.pipeline.trainer import (assemble, build, clip_grad_norm, first_holder, local_buffers,
                                      local_parameters, run_actions, scale_of, sync_gradients, twin)
from hetsynth.runtime.rank_state import precision

TRAIN_STEP = "a pipeline plan runs forward and backward together: use loss = pm.train_step(*inputs)"


class PipelineModule(PlannedModule):
    """This rank's stage of a pipeline plan (module docstring)."""

    def __init__(self, plan: Plan, rank: int, state: Mapping[str, torch.Tensor], keys: Mapping[str, str],
                 device: torch.device, *, dtype: str | None = None, world: Any) -> None:
        super().__init__()
        if torch.device(device).type != "cpu":
            raise NotImplementedError(f"pipeline plans run on CPU ranks only for now (their boundary transfers are "
                                      f"point-to-point sends of CPU tensors), this rank's device is {device}; hide "
                                      f"the GPUs (CUDA_VISIBLE_DEVICES=) or run the plan's SPMD shape")
        if dtype is not None:
            plan = twin(plan, dtype)
        param_fqns = {n.fqn for n in plan.graph.params}
        params = param_fqns | {k for k, fqn in keys.items() if fqn in param_fqns}
        t = build(plan, rank, dict(state), params, world=world, device=device, dtype=dtype)
        vars(self).update(t=t, plan=plan, keys=dict(keys), param_fqns=param_fqns, synced=True, scaler=t.scaler)

    # -- parameters -------------------------------------------------------------------------

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        module = self.t.main.module
        for p in self.t.main.params:
            yield prefix + p.fqn, getattr(module, p.name)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def local_pieces(self) -> dict[str, Piece]:
        """fqn -> this rank's piece of every parameter its stage holds: where it sits in the
        whole tensor, and whether this rank writes it (the first replica of the first stage
        holding it: one writer per element over the world)."""
        t, out = self.t, {}
        splan = t.stage.plans[max(t.stage.plans)]
        for p in t.main.params:
            shape, offsets = tuple(splan.graph.node(p.name).out.shape), [0] * len(splan.graph.node(p.name).out.shape)
            layout = MeshLayout(t.groups.mesh, p.layout)
            if p.layout.is_shard:
                for dim, lengths in splan.lengths(p.name, p.layout).items():
                    offsets[dim] = layout.offset(lengths, dim, t.groups.rank)
            owner = first_holder(t, p.fqn) and layout.counts_once(t.groups.rank)
            out[p.fqn] = Piece(getattr(t.main.module, p.name), tuple(offsets), shape, owner)
        return out

    # -- the step ---------------------------------------------------------------------------

    def train_step(self, *inputs: torch.Tensor, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of every micro-batch, then the gradient sync unless inside
        no_sync(); returns this rank's loss summand (float64, detached). The backward is of
        loss_scale * loss (a mean over accumulation micro-steps), times the loss scaler's scale
        when `scaler` is enabled (then `scaler.unscale_`, `step` and `update` as torch's AMP
        recipe); the returned summand is not scaled."""
        check_rows(self.plan, self.t.rows, self.t.groups.rank, inputs)
        loss_scale *= scale_of(self.t)
        with precision(self.t.dtype):
            loss = run_actions(self.t, list(inputs), loss_scale=loss_scale)
            self.t.outbox.flush()
            if self.synced:
                sync_gradients(self.t)
        return loss.detach()

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """An evaluation pass under torch.no_grad (the loss summand, float64); an error otherwise."""
        if torch.is_grad_enabled():
            raise RuntimeError(TRAIN_STEP)
        check_rows(self.plan, self.t.rows, self.t.groups.rank, inputs)
        with precision(self.t.dtype):
            loss = run_actions(self.t, list(inputs), backward=False)
            self.t.outbox.flush()
        return loss

    # -- the user's calls -------------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient by min(1, max_norm / (||g|| + 1e-6)); returns ||g|| (float64),
        the norm of the whole model's gradient, on every rank (collective)."""
        return torch.tensor(clip_grad_norm(self.t, float(max_norm)), dtype=torch.float64)

    def _world_group(self) -> Any:
        return self.t.world

    def whole_state(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
        """Every parameter and buffer whole, by the plan's names (collective; with
        rank0_only None on the other ranks)."""
        t, mine = self.t, (local_parameters(self.t), local_buffers(self.t))
        world = dist.get_world_size(t.world)
        if rank0_only:
            gathered: list | None = [None] * world if dist.get_rank(t.world) == 0 else None
            dist.gather_object(mine, gathered, dst=0, group=t.world)
            if gathered is None:
                return None
        else:
            gathered = [None] * world
            dist.all_gather_object(gathered, mine, group=t.world)
        buffers = merge_buffers(t, [b for _, b in gathered])
        return assemble(t.plan, [p for p, _ in gathered]) | {k: v.clone() for k, v in buffers.items()}

    def _load_keys(self, by_key: Mapping[str, torch.Tensor]) -> None:
        self._load_whole(by_key)

    def whole_buffers(self) -> dict[str, torch.Tensor]:
        """The plain module's buffers by state-dict key, whole, each as the stage holding it left
        it (collective: every rank calls it, every rank gets them all)."""
        gathered: list[Any] = [None] * dist.get_world_size(self.t.world)
        dist.all_gather_object(gathered, local_buffers(self.t), group=self.t.world)
        by_fqn = merge_buffers(self.t, gathered)
        return {k: by_fqn[f].clone() for k, f in self.keys.items() if f not in self.param_fqns and f in by_fqn}

    def pieces_written(self) -> None:
        """The pieces were written in place (a checkpoint loaded); a stage holds no ZeRO rows
        to gather again, so nothing follows."""

    def load_buffers(self, buffers: Mapping[str, torch.Tensor]) -> None:
        """Whole buffers by state-dict key (whole_buffers' form) into this rank's stage."""
        self._load_whole({k: v for k, v in buffers.items() if k in self.keys})

    def _load_whole(self, by_key: Mapping[str, torch.Tensor]) -> None:
        """Whole tensors by state-dict key: this rank's slices of its stage's parameters, its
        stage's buffers, and the whole buffers the statistics read."""
        t, by_fqn = self.t, {self.keys[k]: v for k, v in by_key.items()}
        splan, rank, module = t.stage.plans[max(t.stage.plans)], t.groups.rank, t.main.module
        with torch.no_grad():
            for p in t.main.params:
                if p.fqn in by_fqn:
                    whole = by_fqn[p.fqn].detach().cpu()
                    getattr(module, p.name).copy_(local_slice(splan, p.name, p.layout, rank, whole, t.groups.mesh))
            for node in splan.graph.nodes:
                if node.op == "buffer" and node.value is None and node.fqn in by_fqn and hasattr(module, node.name):
                    getattr(module, node.name).copy_(by_fqn[node.fqn])
        for name in t.state:
            value = by_key.get(name, by_fqn.get(name))
            if value is not None:
                t.state[name] = value.detach().to("cpu").clone()


__all__ = ["PipelineModule", "TRAIN_STEP"]
