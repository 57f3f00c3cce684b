"""Checkpoints independent of the plan: full tensors, resharded on load.

save  every rank sends its slices of the parameters and of their optimizer state to rank 0
      (gather_object), which reassembles whole tensors and writes one file, whole or not at
      all (instruction_set.files: a failed write leaves the previous checkpoint intact):
        {"format": 2, "model_ref", "step": the number of steps trained,
         "model": the model's state_dict (loadable into the plain single-device module,
                  tied names included; buffers as training left them),
         "optimizer": {"kind", "settings": {"lr", "weight_decay"},
                       "state": {name: {"step", "exp_avg", "exp_avg_sq" | "momentum_buffer"}}},
         "checksums": {"model/<name>" | "optimizer/<name>/<key>": sha256 of the tensor's dtype,
                       shape and bytes}}
load  every rank reads the file and takes its own slices under *its* plan, which may have
      other ratios, layouts or world size than the plan that saved it; buffers are whole.

`read_checkpoint` + `check_resume` validate a checkpoint before any rank starts (the launcher)
and again on every rank: a file torch cannot read (corrupt, truncated, not a checkpoint), a
target step at or before the checkpoint's (resuming continues from its step to `--steps`), an
optimizer of another kind or other settings (its state would not mean the same), a step that
is not an integer >= 0, a tensor whose bytes do not match its checksum (a damaged file would
otherwise resume with wrong weights and a nan loss), and parameters missing or of other
shapes are CheckpointErrors naming the file and the values. Format 1 (no checksums) is still
read, unverified. Files are read with `weights_only=True` (tensors and plain
data only: no code runs on load).
"""

from __future__ import annotations

import hashlib
import logging
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from hetsynth.instruction_set.files import atomic_file
from hetsynth.instruction_set.graph import ReferenceGraph
from hetsynth.instruction_set.models import ModelSpec
from hetsynth.instruction_set.plan import Plan
from hetsynth.runtime.codegen import local_slice
from hetsynth.runtime.config import TrainConfig
from hetsynth.runtime.rank_state import assemble
from hetsynth.runtime.train import Trainer, model_buffers

FORMAT = 2
READABLE_FORMATS = (1, 2)  # 1: no checksums

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model being trained."""


def _local_state(trainer: Trainer) -> dict[str, tuple[str, torch.Tensor, dict[str, Any]]]:
    module = trainer.program.module
    out = {}
    for p in trainer.program.params:
        param = getattr(module, p.name)
        held = trainer.zero.leaf_of(param) if trainer.zero is not None else param  # ZeRO-1: this rank's rows
        state = {k: (v.detach().cpu() if torch.is_tensor(v) else v)
                 for k, v in trainer.optimizer.state.get(held, {}).items()}
        out[p.fqn] = (p.layout, param.detach().cpu(), state)
    return out


def _assemble_state(plan: Plan, gathered: list[dict]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    params = assemble(plan, [{k: (v[0], v[1]) for k, v in g.items()} for g in gathered])
    optim: dict[str, dict] = {}
    rows = _zero_fqns(plan)
    for fqn, (layout, _, state) in gathered[0].items():
        entry: dict[str, Any] = {}
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0 and fqn in rows:  # ZeRO-1: every rank's rows
                entry[key] = torch.cat([g[fqn][2][key] for g in gathered])
            elif torch.is_tensor(value) and value.dim() > 0:
                entry[key] = assemble(plan, [{fqn: (layout, g[fqn][2][key])} for g in gathered])[fqn]
            else:
                entry[key] = value
        optim[fqn] = entry
    return params, optim


def _zero_fqns(plan: Plan) -> dict[str, str]:
    """fqn -> plan tensor of the ZeRO-1 parameters (their optimizer state is held in rows)."""
    if plan.state_shards is None:
        return {}
    return {plan.graph.node(name).fqn: name for name in plan.state_shards.rows}


def _rows(plan: Plan, name: str, rank: int, full: torch.Tensor) -> torch.Tensor:
    rows = plan.state_shards.rows[name]  # type: ignore[union-attr]
    return full.narrow(0, sum(rows[:rank]), rows[rank])


def save_checkpoint(trainer: Trainer, path: str | Path, step: int) -> None:
    """Collective: every rank calls it; rank 0 writes `path`."""
    group = trainer.groups.group("all")
    gathered: list[Any] | None = [None] * trainer.plan.cluster.num_devices if trainer.groups.rank == 0 else None
    dist.gather_object(_local_state(trainer), gathered, dst=0, group=group)
    if trainer.groups.rank == 0:
        params, optim = _assemble_state(trainer.plan, gathered)  # type: ignore[arg-type]
        write_checkpoint(path, model_ref=trainer.plan.model.ref, step=step, model=_model_state_dict(trainer, params),
                         optimizer={"kind": trainer.config.optimizer, "settings": optimizer_settings(trainer.config),
                                    "state": optim})
    dist.barrier(group=group)


def write_checkpoint(path: str | Path, *, model_ref: str, step: int, model: dict[str, torch.Tensor],
                     optimizer: dict[str, Any]) -> None:
    """Write a checkpoint of the current FORMAT, with its checksums, whole or not at all."""
    ckpt = {"format": FORMAT, "model_ref": model_ref, "step": step, "model": model, "optimizer": optimizer}
    save_atomic(ckpt | {"checksums": checksums(ckpt)}, path)


def save_atomic(obj: Any, path: str | Path) -> None:
    """torch.save `obj` to `path` whole or not at all (WriteError naming the path and reason)."""
    with atomic_file(path) as f:
        torch.save(obj, f)


def checksums(ckpt: dict[str, Any]) -> dict[str, str]:
    """{"model/<name>" | "optimizer/<name>/<key>": sha256} of every tensor of a checkpoint."""
    out = {f"model/{k}": tensor_digest(v) for k, v in ckpt["model"].items()}
    for name, state in ckpt["optimizer"]["state"].items():
        out |= {f"optimizer/{name}/{k}": tensor_digest(v) for k, v in state.items() if torch.is_tensor(v)}
    return out


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (in row-major order)."""
    digest = hashlib.sha256(f"{tensor.dtype} {tuple(tensor.shape)}".encode())
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if flat.numel():
        digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()


def _model_state_dict(trainer: Trainer, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return model_state_dict(trainer.spec, params, model_buffers(trainer))


def model_state_dict(spec: ModelSpec, params: dict[str, torch.Tensor],
                     buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain model's state_dict keys, filled with the trained parameters (tied aliases
    get the same tensor) and the model's whole buffers."""
    module = spec.build("meta")
    named = list(module.named_parameters(remove_duplicate=False))
    out = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.nn.Parameter):
            aliases = [n for n, p in named if p is value]
            out[key] = params[next(n for n in aliases if n in params)]
        else:
            out[key] = buffers[key]
    return out


def optimizer_settings(config: TrainConfig) -> dict[str, float]:
    """The optimizer settings a checkpoint's state depends on (resuming must use the same)."""
    return {"lr": config.lr, "weight_decay": config.weight_decay}


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """A hetsynth checkpoint, or CheckpointError saying why `path` is not one."""
    where = f"--resume {str(path)!r}"
    if Path(path).is_dir():
        raise CheckpointError(f"{where}: is a directory, not a checkpoint file")
    if not Path(path).exists():
        raise CheckpointError(f"{where}: no such file")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{where}: not a checkpoint torch can read (not the zip archive torch.save "
                              f"writes: corrupt or truncated?)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # whatever torch says about a file it cannot read
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{where}: not a checkpoint torch can read ({why})") from None
    keys = {"format", "step", "model", "optimizer"}
    if not isinstance(ckpt, dict) or ckpt.get("format") not in READABLE_FORMATS or not keys <= set(ckpt):
        found = ckpt.get("format") if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(f"{where}: not a hetsynth checkpoint of format {FORMAT} (found {found!r}; "
                              f"hetsynth run --save writes them)")
    step = ckpt["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{where}: step {step!r} is not a number of steps trained (an integer >= 0); "
                              f"the file is damaged or not written by hetsynth run --save")
    _check_tensors(ckpt, where)
    return ckpt


def _check_tensors(ckpt: dict[str, Any], where: str) -> None:
    """Every tensor against its checksum (format 2; format 1 has none: read as it is)."""
    if ckpt["format"] == 1:
        log.debug("%s is checkpoint format 1, which has no checksums: its tensors are not verified", where)
        return
    saved = ckpt.get("checksums")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{where}: format {FORMAT} checkpoint without its checksums (damaged?)")
    try:
        found = checksums(ckpt)
    except (AttributeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{where}: model or optimizer state of the wrong structure ({err})") from None
    bad = [name for name in sorted(set(saved) | set(found)) if saved.get(name) != found.get(name)]
    if bad:
        what = "; ".join(f"{n} ({_mismatch(n, saved, found)})" for n in bad[:3])
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise CheckpointError(f"{where}: tensor(s) do not match the checksums written with them: {what}{more}; "
                              f"the file was damaged or changed after it was saved: resume from another checkpoint")


def _mismatch(name: str, saved: dict[str, str], found: dict[str, str]) -> str:
    if name not in found:
        return "missing"
    return "not checksummed" if name not in saved else "bytes differ"


def check_resume(ckpt: dict[str, Any], path: str | Path, plan: Plan, config: TrainConfig,
                 steps: int | None = None) -> int:
    """The step `ckpt` holds, after checking that it can resume training `plan` with
    `config` up to `steps` (see the module docstring)."""
    where, step = f"--resume {str(path)!r}", ckpt["step"]
    if steps is not None and steps <= step:
        raise CheckpointError(f"{where} holds step {step}; --steps {steps} is not after it: give --steps more "
                              f"than {step} (the run continues with step {step + 1})")
    kind = ckpt["optimizer"].get("kind")
    if kind != config.optimizer:
        raise CheckpointError(f"{where} was trained with --optimizer {kind}, not {config.optimizer}: its optimizer "
                              f"state does not fit; resume with --optimizer {kind}")
    saved, now = ckpt["optimizer"].get("settings", {}), optimizer_settings(config)
    differ = [f"{k} {now[k]:g} (checkpoint {saved[k]:g})" for k in now if k in saved and saved[k] != now[k]]
    if differ:
        raise CheckpointError(f"{where}: optimizer settings differ: {', '.join(differ)}; resume with the "
                              f"checkpoint's settings")
    _check_params(ckpt, where, plan)
    return step


def _check_params(ckpt: dict[str, Any], where: str, plan: Plan) -> None:
    bad = []
    for node in plan.graph.params:
        full = ckpt["model"].get(node.fqn)
        if full is None:
            bad.append(f"{node.fqn}: missing")
        elif tuple(full.shape) != tuple(node.out.shape):
            bad.append(f"{node.fqn}: checkpoint shape {tuple(full.shape)}, model {tuple(node.out.shape)}")
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise CheckpointError(f"{where} does not fit the model (checkpoint {ckpt.get('model_ref')!r}, training "
                              f"{plan.model.ref!r}): {'; '.join(bad[:3])}{more}")


def load_checkpoint(trainer: Trainer, path: str | Path, steps: int | None = None) -> int:
    """Take this rank's slices of a checkpoint under this trainer's plan (checked first,
    against `steps` too when given); returns the step it holds."""
    ckpt = read_checkpoint(path)
    step = check_resume(ckpt, path, trainer.plan, trainer.config, steps)
    plan, rank, module = trainer.plan, trainer.groups.rank, trainer.program.module
    zero3 = trainer.zero.zero3() if trainer.zero is not None else set()
    for p in trainer.program.params:
        param = getattr(module, p.name)
        full = ckpt["model"][p.fqn]
        with torch.no_grad():  # a ZeRO-3 parameter is held as its rows
            param.copy_(_rows(plan, p.name, rank, full) if p.name in zero3 else local_slice(plan, p.name, p.layout, rank, full))
        state = ckpt["optimizer"]["state"].get(p.fqn, {})
        zero = p.fqn in _zero_fqns(plan)
        held = trainer.zero.leaf_of(param) if trainer.zero is not None else param
        take = ((lambda v, n=p.name: _rows(plan, n, rank, v)) if zero
                else (lambda v, n=p.name, layout=p.layout: local_slice(plan, n, layout, rank, v)))
        trainer.optimizer.state[held] = state_slices(state, take, param)
    load_buffers(module, plan.graph, ckpt["model"], str(path))
    trainer.buffers.update({k: v for k, v in ckpt["model"].items() if k in trainer.buffers})
    return step


def state_slices(state: dict[str, Any], take: Callable[[torch.Tensor], torch.Tensor],
                 like: torch.Tensor) -> dict[str, Any]:
    """A parameter's optimizer state for this rank: `take` (its slice) of every tensor of one
    or more dims, copied to `like`'s device and dtype (the file is memory-mapped); scalars
    cloned."""
    return {k: (take(v).to(like.device, like.dtype, copy=True) if torch.is_tensor(v) and v.dim() > 0
                else v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}


def load_buffers(module: torch.nn.Module, graph: ReferenceGraph, state: dict[str, torch.Tensor], path: str) -> None:
    """The buffers `graph` reads that `module` stores, from a checkpoint's model state."""
    for node in graph.nodes:
        if node.op != "buffer" or node.value is not None or not hasattr(module, node.name):
            continue  # constants are not the model's state; an unread buffer is not stored
        if node.fqn not in state:
            raise CheckpointError(f"{path} has no buffer {node.fqn!r}")
        with torch.no_grad():
            getattr(module, node.name).copy_(state[node.fqn])
