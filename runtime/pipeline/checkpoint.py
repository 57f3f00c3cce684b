"""Checkpoints of pipeline plans, in runtime.checkpoint's plan-independent format.

A pipeline checkpoint is the same file as an SPMD plan's (whole parameters under the plain
model's state_dict names, whole optimizer state per parameter, whole buffers), so a run may
save under a pipeline plan and resume under an SPMD plan, another pipeline (other stages, cuts,
ratios or micro-batches), or the other way round.

save  every rank sends (its stage, each parameter's storage layout and slice, the optimizer
      state of that slice, the buffers as its stage left them) to rank 0, which reassembles
      whole tensors from the first stage holding each parameter (a tied parameter several
      stages hold has the same value and state on each: their gradients are summed over the
      holders before every step) and writes the file (runtime.checkpoint.write_checkpoint:
      with its checksums, whole or not at all);
load  every rank checks the file (runtime.checkpoint.check_resume) and takes its slices under
      its stage's plan on the stage's sub-mesh.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetsynth.runtime.checkpoint import (check_resume, load_buffers, model_state_dict, optimizer_settings, read_checkpoint,
                                state_slices, write_checkpoint)
from hetsynth.runtime.codegen import local_slice
from hetsynth.runtime.pipeline.trainer import PipelineTrainer, assemble, local_buffers, local_parameters

Slices = dict[str, tuple[int, str, torch.Tensor]]  # fqn -> (stage, storage layout, this rank's slice)


def _local_state(t: PipelineTrainer) -> tuple[Slices, dict[str, dict[str, Any]], dict[str, torch.Tensor]]:
    """(parameter slices, their optimizer state, the buffers) of this rank."""
    module, optim = t.main.module, {}
    for p in t.main.params:
        state = t.optimizer.state.get(getattr(module, p.name), {})
        optim[p.fqn] = {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in state.items()}
    return local_parameters(t), optim, local_buffers(t)


def whole_buffers(t: PipelineTrainer, gathered: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every buffer as the stage that holds it left it (the first rank of each stage)."""
    out = {k: v for b in gathered for k, v in b.items()}
    for stage in t.pipeline.stages:
        out |= gathered[stage.first_rank]
    return out


def _whole_optimizer_state(t: PipelineTrainer, slices: list[Slices], states: list[dict]) -> dict[str, dict]:
    """fqn -> {key: whole tensor, or the scalar} from every rank's slices of the state."""
    out: dict[str, dict[str, Any]] = {}
    owner = assemble(t.plan, slices)  # whole parameters: which fqns there are
    for fqn in owner:
        ranks = [r for r, s in enumerate(slices) if fqn in s]
        first = min(ranks, key=lambda r: slices[r][fqn][0])
        entry: dict[str, Any] = {}
        for key, value in states[first][fqn].items():
            if torch.is_tensor(value) and value.dim() > 0:
                per_rank = [{fqn: (slices[r][fqn][0], slices[r][fqn][1], states[r][fqn][key])} if r in ranks else {}
                            for r in range(len(slices))]
                entry[key] = assemble(t.plan, per_rank)[fqn]
            else:
                entry[key] = value
        out[fqn] = entry
    return out


def save_pipeline_checkpoint(t: PipelineTrainer, path: str | Path, step: int) -> None:
    """Collective over the world: every rank calls it; rank 0 writes `path`."""
    rank = dist.get_rank(t.world)
    gathered: list[Any] | None = [None] * dist.get_world_size(t.world) if rank == 0 else None
    dist.gather_object(_local_state(t), gathered, dst=0, group=t.world)
    if gathered is not None:
        slices, states, buffers = ([g[i] for g in gathered] for i in range(3))
        params = assemble(t.plan, slices)
        write_checkpoint(path, model_ref=t.plan.model.ref, step=step,
                         model=model_state_dict(t.spec, params, whole_buffers(t, buffers)),
                         optimizer={"kind": t.config.optimizer, "settings": optimizer_settings(t.config),
                                    "state": _whole_optimizer_state(t, slices, states)})
    dist.barrier(group=t.world)


def load_pipeline_checkpoint(t: PipelineTrainer, path: str | Path, steps: int | None = None) -> int:
    """Take this rank's slices of a checkpoint (any plan's) under its stage's plan; returns the
    step it holds."""
    ckpt = read_checkpoint(path)
    step = check_resume(ckpt, path, t.plan, t.config, steps)
    plan, mesh, rank, module = t.stage.plans[max(t.stage.plans)], t.groups.mesh, t.groups.rank, t.main.module
    for p in t.main.params:
        param = getattr(module, p.name)
        with torch.no_grad():
            param.copy_(local_slice(plan, p.name, p.layout, rank, ckpt["model"][p.fqn], mesh))
        take = lambda v, n=p.name, layout=p.layout: local_slice(plan, n, layout, rank, v, mesh)
        t.optimizer.state[param] = state_slices(ckpt["optimizer"]["state"].get(p.fqn, {}), take, param)
    load_buffers(module, plan.graph, ckpt["model"], str(path))
    t.state.update({k: ckpt["model"][k].clone() for k in t.state if k in ckpt["model"]})
    return step
