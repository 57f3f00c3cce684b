"""Checkpoints independent of the plan: full tensors, resharded on load.

save  every rank sends its slices of the parameters and of their optimizer state to rank 0
      (gather_object), which reassembles whole tensors and writes one file:
        {"format": 1, "model_ref", "step",
         "model": the model's state_dict (loadable into the plain single-device module,
                  tied names included),
         "optimizer": {"kind", "state": {name: {"step", "exp_avg", "exp_avg_sq" | "momentum_buffer"}}}}
load  every rank reads the file and takes its own slices under *its* plan, which may have
      other ratios, layouts or world size than the plan that saved it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from instruction_set.plan import Plan
from runtime.codegen import local_slice
from runtime.train import Trainer, assemble

FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model being trained."""


def _local_state(trainer: Trainer) -> dict[str, tuple[str, torch.Tensor, dict[str, Any]]]:
    module = trainer.program.module
    out = {}
    for p in trainer.program.params:
        param = getattr(module, p.name)
        state = {k: (v.detach().cpu() if torch.is_tensor(v) else v)
                 for k, v in trainer.optimizer.state.get(param, {}).items()}
        out[p.fqn] = (p.layout, param.detach().cpu(), state)
    return out


def _assemble_state(plan: Plan, gathered: list[dict]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    params = assemble(plan, [{k: (v[0], v[1]) for k, v in g.items()} for g in gathered])
    optim: dict[str, dict] = {}
    for fqn, (layout, _, state) in gathered[0].items():
        entry: dict[str, Any] = {}
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                entry[key] = assemble(plan, [{fqn: (layout, g[fqn][2][key])} for g in gathered])[fqn]
            else:
                entry[key] = value
        optim[fqn] = entry
    return params, optim


def save_checkpoint(trainer: Trainer, path: str | Path, step: int) -> None:
    """Collective: every rank calls it; rank 0 writes `path`."""
    group = trainer.groups.group("all")
    gathered: list[Any] | None = [None] * trainer.plan.cluster.num_devices if trainer.groups.rank == 0 else None
    dist.gather_object(_local_state(trainer), gathered, dst=0, group=group)
    if trainer.groups.rank == 0:
        params, optim = _assemble_state(trainer.plan, gathered)  # type: ignore[arg-type]
        torch.save({"format": FORMAT, "model_ref": trainer.plan.model.ref, "step": step,
                    "model": _model_state_dict(trainer, params),
                    "optimizer": {"kind": trainer.config.optimizer, "state": optim}}, path)
    dist.barrier(group=group)


def _model_state_dict(trainer: Trainer, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain model's state_dict keys, filled with the trained parameters (tied aliases
    get the same tensor) and the model's buffers."""
    module = trainer.spec.build("meta")
    named = list(module.named_parameters(remove_duplicate=False))
    out = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.nn.Parameter):
            aliases = [n for n, p in named if p is value]
            out[key] = params[next(n for n in aliases if n in params)]
        else:
            out[key] = trainer.buffers[key]
    return out


def load_checkpoint(trainer: Trainer, path: str | Path) -> int:
    """Take this rank's slices of a checkpoint under this trainer's plan; returns the step."""
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {ckpt.get('format')!r}, expected {FORMAT}")
    plan, rank, module = trainer.plan, trainer.groups.rank, trainer.program.module
    for p in trainer.program.params:
        if p.fqn not in ckpt["model"]:
            raise CheckpointError(f"{path} has no parameter {p.fqn!r} (model {ckpt.get('model_ref')!r}, "
                                  f"training {plan.model.ref!r})")
        param = getattr(module, p.name)
        full = ckpt["model"][p.fqn]
        if tuple(full.shape) != tuple(plan.graph.node(p.name).out.shape):
            raise CheckpointError(f"{p.fqn}: checkpoint shape {tuple(full.shape)}, model "
                                  f"{tuple(plan.graph.node(p.name).out.shape)}")
        with torch.no_grad():
            param.copy_(local_slice(plan, p.name, p.layout, rank, full))
        state = ckpt["optimizer"]["state"].get(p.fqn, {})
        trainer.optimizer.state[param] = {
            k: (local_slice(plan, p.name, p.layout, rank, v).clone().to(param.device)
                if torch.is_tensor(v) and v.dim() > 0 else v)
            for k, v in state.items()}
    return int(ckpt["step"])
