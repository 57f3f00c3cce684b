"""Checkpoints through torch.distributed.checkpoint (DCP): every rank writes only its own pieces,
and a run under any other plan (world size, ratios, ZeRO stage, SPMD or pipeline) reads only
its new pieces.

A module `pm` of a plan (runtime.parallel.ParallelModule, runtime.pipeline.module.PipelineModule)
gives `local_pieces()`: fqn -> Piece(tensor, offsets, shape, owner), the box
[offsets, offsets + tensor.shape) of the whole tensor of `shape` that this rank holds, exactly
one owner per element. The DCP state dict, one flat dict:

    model.<fqn>                 a parameter (graph fqn; tied names share one), whole shape
    optim.state.<fqn>.<name>    an optimizer state tensor of the parameter's piece shape
                                (AdamW's exp_avg, exp_avg_sq), sharded as the parameter;
                                other state (the scalar `step`) a plain tensor or an object
    buffer.<fqn>                a buffer, whole (replicated: DCP writes one copy)
    hetsynth                    the record: pickled bytes of {"format", "step", "params":
                                {fqn: shape}, "keys": {state-dict key: fqn}, "optimizer": class
                                name, "param_groups": [hyperparameters + "params": [fqn]],
                                "state": {fqn: {name: "piece" | "tensor" | "object"}}, "extra"}

A piece is a ShardedTensor with one local shard at its offsets. DTensor's Shard placement
cannot express uneven lengths or ZeRO's row ranges, and DCP reads only a ShardedTensor's
local shards and its global size: on save the owner's shard is one chunk of the saved tensor
(non-owners give none), on load each rank's shard is read from whichever saved chunks overlap
it (DCP's chunk-overlap reads), replicas included. The ShardedTensor's global metadata is the
local shard plus a partition of the rest of the tensor (`_complement`), so that it is valid
without a collective.

Load checks the checkpoint against the plan's model (every parameter's name and whole shape)
and the optimizer class before any tensor is read; a mismatch is a ValueError naming the
first differing parameter. Optimizer state that AdamW creates lazily is created first by a
step with zero gradients and lr 0 (torch.distributed.checkpoint.state_dict's approach).
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
import uuid
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

FORMAT = 1
RECORD = "hetsynth"

Box = tuple[list[int], list[int]]


# -- pieces as ShardedTensors -------------------------------------------------------------------

def _complement(offsets: list[int], sizes: list[int], shape: list[int]) -> list[Box]:
    """Boxes that partition the whole tensor minus the box (offsets, sizes): for each dim d, the
    parts before and after the box along d, inside the box along the dims before d."""
    out = []
    for d in range(len(shape)):
        lead_o, lead_s = offsets[:d], sizes[:d]
        tail_o, tail_s = [0] * (len(shape) - d - 1), shape[d + 1:]
        end = offsets[d] + sizes[d]
        if offsets[d] > 0:
            out.append((lead_o + [0] + tail_o, lead_s + [offsets[d]] + tail_s))
        if end < shape[d]:
            out.append((lead_o + [end] + tail_o, lead_s + [shape[d] - end] + tail_s))
    return out


def _sharded(tensor: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...]) -> ShardedTensor:
    """A ShardedTensor of whole size `shape` whose one local shard is `tensor` (shared storage)
    at `offsets`; the rest of the tensor is placed on another rank in its metadata."""
    rank, world = dist.get_rank(), dist.get_world_size()
    where = "cpu" if tensor.device.type == "cpu" else str(tensor.device)
    local = ShardMetadata(list(offsets), list(tensor.shape), f"rank:{rank}/{where}")
    rest = _complement(list(offsets), list(tensor.shape), list(shape))
    assert world > 1 or not rest, "a single rank holds whole tensors"
    other = f"rank:{(rank + 1) % world}/{where}"
    props = TensorProperties(dtype=tensor.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    meta = ShardedTensorMetadata([local] + [ShardMetadata(o, s, other) for o, s in rest], torch.Size(shape), props)
    return ShardedTensor._init_from_local_shards_and_global_metadata([Shard(tensor, local)], meta)


def _is_piece(value: Any, piece: torch.Tensor) -> bool:
    """An optimizer state tensor sharded as its parameter (not a scalar such as `step`)."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == piece.shape


# -- the record ---------------------------------------------------------------------------------

def model_params(pm: Any) -> dict[str, tuple[int, ...]]:
    """fqn -> whole shape of every parameter of the plan's model (every stage's)."""
    return {n.fqn: tuple(n.out.shape) for n in pm.plan.graph.params}


def _optimizer_layout(optimizer: torch.optim.Optimizer | None, names: Mapping[int, str]) -> dict:
    """This rank's param groups (fqns) and state kinds, gathered into the record."""
    if optimizer is None:
        return {"groups": [], "state": {}}
    groups = [[_fqn(names, p) for p in g["params"]] for g in optimizer.param_groups]
    state = {}
    for p, values in optimizer.state.items():
        state[_fqn(names, p)] = {k: ("piece" if _is_piece(v, p) else "tensor" if torch.is_tensor(v) else "object")
                                 for k, v in values.items()}
    return {"groups": groups, "state": state}


def _fqn(names: Mapping[int, str], param: torch.Tensor) -> str:
    if id(param) not in names:
        raise ValueError(f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not one of the "
                         "module's (build it on pm.parameters())")
    return names[id(param)]


def _record(pm: Any, optimizer: torch.optim.Optimizer | None, step: int, extra: Any,
            names: Mapping[int, str]) -> bytes:
    """The record (module docstring), the same on every rank (the ranks' layouts gathered)."""
    layouts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, _optimizer_layout(optimizer, names))
    groups: list[dict] = []
    if optimizer is not None:
        for i, g in enumerate(optimizer.param_groups):
            fqns = dict.fromkeys(f for lay in layouts for f in lay["groups"][i])
            groups.append({k: v for k, v in g.items() if k != "params"} | {"params": list(fqns)})
    state = {f: kinds for lay in layouts for f, kinds in lay["state"].items()}
    return pickle.dumps({"format": FORMAT, "step": int(step), "params": model_params(pm), "keys": dict(pm.keys),
                         "optimizer": type(optimizer).__name__ if optimizer is not None else None,
                         "param_groups": groups, "state": state, "extra": extra})


def _read_whole(path: str | Path, keys: set[str]) -> dict[str, Any]:
    """The entries `keys` of the checkpoint, whole, read on this process alone."""
    sd: dict[str, Any] = {}
    _load_state_dict(sd, storage_reader=dcp.FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(keys=keys),
                     no_dist=True)
    return sd


def read_record(path: str | Path) -> dict:
    """The record of the checkpoint at `path`, read on this process alone (no process group)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise ValueError(f"{str(path)!r} is not a DCP checkpoint (no {path / '.metadata'})")
    sd = _read_whole(path, {RECORD})
    if RECORD not in sd:
        raise ValueError(f"{str(path)!r} is a DCP checkpoint but not hetsynth's (no {RECORD!r} record)")
    record = pickle.loads(sd[RECORD])
    if record.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r}: checkpoint format {record.get('format')!r}, this hetsynth reads {FORMAT}")
    return record


def check_model(record: Mapping, params: Mapping[str, tuple[int, ...]], path: str | Path) -> None:
    """ValueError naming the first parameter whose name or whole shape differs."""
    saved = {f: tuple(s) for f, s in record["params"].items()}
    for fqn, shape in params.items():
        if fqn not in saved:
            raise ValueError(f"checkpoint {str(path)!r} is of another model: parameter {fqn!r} {shape} of this "
                             f"model is not in it")
        if saved[fqn] != shape:
            raise ValueError(f"checkpoint {str(path)!r} is of another model: parameter {fqn!r} has shape "
                             f"{saved[fqn]} there, {shape} here")
    for fqn, shape in saved.items():
        if fqn not in params:
            raise ValueError(f"checkpoint {str(path)!r} is of another model: its parameter {fqn!r} {shape} is not "
                             f"in this model")


# -- save ---------------------------------------------------------------------------------------

def _entry(tensor: torch.Tensor, piece: Any) -> torch.Tensor:
    """A piece-shaped tensor as DCP takes it: a ShardedTensor at the piece's offsets (a 0-dim
    tensor, always whole, plain)."""
    if tensor.dim() == 0:
        return tensor
    return _sharded(tensor, piece.offsets, piece.shape)


def _state_entries(optimizer: torch.optim.Optimizer | None, pieces: Mapping[str, Any],
                   names: Mapping[int, str]) -> dict[str, Any]:
    """optim.state.<fqn>.<name>: piece-shaped state from the piece's owner, other tensors and
    objects from every rank that holds them (DCP writes one copy)."""
    out: dict[str, Any] = {}
    for p, values in (optimizer.state.items() if optimizer is not None else ()):
        fqn = _fqn(names, p)
        piece = pieces[fqn]
        for name, value in values.items():
            key = f"optim.state.{fqn}.{name}"
            if not _is_piece(value, p):
                out[key] = value
            elif piece.owner and value.numel():
                out[key] = _entry(value.detach().contiguous(), piece)
    return out


def save(path: str | Path, pm: Any, optimizer: torch.optim.Optimizer | None = None, *, step: int = 0,
         extra: Any = None) -> None:
    """Collective: every rank writes its own pieces of the parameters and of their optimizer
    state under `path` (a directory), one copy of the buffers and the record (module docstring)."""
    pieces = pm.local_pieces()
    names = {id(p.tensor): fqn for fqn, p in pieces.items()}
    sd: dict[str, Any] = {f"model.{fqn}": _entry(p.tensor.detach().contiguous(), p)
                          for fqn, p in pieces.items() if p.owner and p.tensor.numel()}
    sd |= _state_entries(optimizer, pieces, names)
    sd |= {f"buffer.{pm.keys[k]}": v for k, v in pm.whole_buffers().items()}
    sd[RECORD] = _record(pm, optimizer, step, extra, names)
    partial = _partial_dir(Path(path))
    partial.mkdir(parents=True, exist_ok=True)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(partial))
    if dist.get_rank() == 0:
        _replace_dir(partial, Path(path))
    dist.barrier()


def _partial_dir(final: Path) -> Path:
    """Where the ranks write before the checkpoint replaces `final` (a name rank 0 picks);
    refuses to replace a directory that is not a checkpoint."""
    if final.exists() and not (final / ".metadata").is_file() and (not final.is_dir() or any(final.iterdir())):
        raise ValueError(f"{str(final)!r} exists and is not a DCP checkpoint; save the checkpoint elsewhere")
    name = [f".{final.name}.partial-{uuid.uuid4().hex[:8]}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return final.parent / name[0]


def _replace_dir(partial: Path, final: Path) -> None:
    """The written checkpoint in place of `final`: an interrupted save leaves the previous
    checkpoint intact (the directory is swapped by two renames once every rank has written)."""
    old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
    if final.exists():
        os.replace(final, old)
    os.replace(partial, final)
    shutil.rmtree(old, ignore_errors=True)


# -- load ---------------------------------------------------------------------------------------

def _check_optimizer(record: Mapping, optimizer: torch.optim.Optimizer | None, path: str | Path) -> None:
    if optimizer is None:
        return
    if record["optimizer"] is None:
        raise ValueError(f"checkpoint {str(path)!r} holds no optimizer state; load it without the optimizer")
    if record["optimizer"] != type(optimizer).__name__:
        raise ValueError(f"checkpoint {str(path)!r} holds the state of a {record['optimizer']}, "
                         f"the optimizer given is a {type(optimizer).__name__}")
    saved = record["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"checkpoint {str(path)!r} has {len(saved)} optimizer param groups, the optimizer "
                         f"{len(optimizer.param_groups)}")


def create_state(optimizer: torch.optim.Optimizer) -> None:
    """Optimizer state for every parameter that has none (AdamW creates it at its first step):
    one step with zero gradients and lr 0 on those parameters only (the others' gradients set
    aside, so that their state does not move); gradients and lr restored after."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(p in optimizer.state for p in params):
        return
    grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for p in params:
        p.grad = None if p in optimizer.state else torch.zeros_like(p)
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if torch.is_tensor(g["lr"]) else 0.0
    optimizer.step()
    for p, grad in zip(params, grads):
        p.grad = grad
    for g, lr in zip(optimizer.param_groups, lrs):
        if lr is not None:
            g["lr"] = lr


def _target(tensor: torch.Tensor, piece: Any, copies: list) -> torch.Tensor:
    """Where DCP reads a piece: the tensor itself (contiguous) or a contiguous copy written back
    after the load (`copies`)."""
    into = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
    if into is not tensor:
        copies.append((tensor, into))
    return _entry(into, piece)


class _Loaded:
    """Placeholder of an object read by DCP into the state dict under `key`."""

    def __init__(self, key: str) -> None:
        self.key = key


def _state_targets(optimizer: torch.optim.Optimizer, record: Mapping, pieces: Mapping[str, Any],
                   metadata: Any, copies: list) -> tuple[dict[str, Any], dict[torch.Tensor, dict[str, Any]]]:
    """The DCP entries optim.state.<fqn>.<name> of the parameters the optimizer holds, and their
    new state ({name: tensor read in place, or _Loaded}); a parameter without saved state gets
    none (as under a fresh optimizer)."""
    held = {p for g in optimizer.param_groups for p in g["params"]}
    sd: dict[str, Any] = {}
    state: dict[torch.Tensor, dict[str, Any]] = {}
    for fqn, piece in pieces.items():
        p = piece.tensor
        if p not in held or fqn not in record["state"]:
            continue
        current, state[p] = optimizer.state.get(p, {}), {}
        for name, kind in record["state"][fqn].items():
            key, now = f"optim.state.{fqn}.{name}", current.get(name)
            if kind == "piece":
                now = now if _is_piece(now, p) else torch.zeros_like(p)
                if now.numel():
                    sd[key] = _target(now, piece, copies)
            elif kind == "tensor":
                md = metadata.state_dict_metadata[key]
                if not (torch.is_tensor(now) and now.shape == md.size):
                    now = torch.empty(md.size, dtype=md.properties.dtype)
                sd[key] = now
            else:
                now = sd[key] = _Loaded(key)
            state[p][name] = now
    return sd, state


def _check_groups(optimizer: torch.optim.Optimizer, record: Mapping, names: Mapping[int, str],
                  path: str | Path) -> None:
    """Every parameter of the optimizer's group i was in the saved group i."""
    for i, (group, saved) in enumerate(zip(optimizer.param_groups, record["param_groups"])):
        for p in group["params"]:
            if _fqn(names, p) not in saved["params"]:
                raise ValueError(f"checkpoint {str(path)!r}: parameter {_fqn(names, p)!r} is in optimizer param "
                                 f"group {i} here, not there")


def _buffer_targets(pm: Any, metadata: Any, path: str | Path) -> dict[str, torch.Tensor]:
    """An empty tensor for each of the module's buffers (state-dict keys) that DCP reads into;
    a buffer the checkpoint lacks is a ValueError."""
    out = {}
    for key, value in pm.whole_buffers().items():
        if f"buffer.{pm.keys[key]}" not in metadata.state_dict_metadata:
            raise ValueError(f"checkpoint {str(path)!r} has no buffer {key!r}")
        out[key] = torch.empty_like(value)
    return out


def _check(record: Mapping, pm: Any, optimizer: torch.optim.Optimizer | None, names: Mapping[int, str],
           path: str | Path) -> None:
    """Before anything is read: the model, the optimizer's class and its groups."""
    check_model(record, model_params(pm), path)
    _check_optimizer(record, optimizer, path)
    if optimizer is not None:
        _check_groups(optimizer, record, names, path)


def _set_optimizer(optimizer: torch.optim.Optimizer, state: Mapping, sd: Mapping[str, Any], record: Mapping) -> None:
    """The state read (objects from the DCP state dict) and the saved hyperparameters, by group."""
    for p, values in state.items():
        optimizer.state[p] = {k: sd[v.key] if isinstance(v, _Loaded) else v for k, v in values.items()}
    for group, saved in zip(optimizer.param_groups, record["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})


def load(path: str | Path, pm: Any, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Collective: this rank's pieces of the parameters (and of their optimizer state, and the
    optimizer's hyperparameters) read from the checkpoint at `path`, written under any plan of
    the same model; the buffers whole. Returns the saved step."""
    record, metadata = read_record(path), dcp.FileSystemReader(path).read_metadata()
    pieces = pm.local_pieces()
    _check(record, pm, optimizer, {id(p.tensor): fqn for fqn, p in pieces.items()}, path)
    buffers = _buffer_targets(pm, metadata, path)
    if optimizer is not None:
        create_state(optimizer)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    sd: dict[str, Any] = {f"model.{fqn}": _target(p.tensor.detach(), p, copies)
                          for fqn, p in pieces.items() if p.tensor.numel()}
    sd |= {f"buffer.{pm.keys[k]}": v for k, v in buffers.items()}
    entries, state = ({}, {}) if optimizer is None else _state_targets(optimizer, record, pieces, metadata, copies)
    sd |= entries
    with torch.no_grad():
        dcp.load(sd, storage_reader=dcp.FileSystemReader(path))
        for tensor, read in copies:
            tensor.copy_(read)
    pm.load_buffers(buffers)
    if optimizer is not None:
        _set_optimizer(optimizer, state, sd, record)
    _params_written(pm)
    return int(record["step"])


def _params_written(pm: Any) -> None:
    """The module's pieces were written behind its back: under ZeRO-1/2 the whole parameters
    are gathered from the rows again before the next use (as after an optimizer step)."""
    pm.pieces_written()


def load_extra(path: str | Path) -> Any:
    """The `extra` given to save (no process group needed)."""
    return read_record(path)["extra"]


def read_model(path: str | Path) -> dict[str, torch.Tensor]:
    """The plain module's state dict (its keys, tied names included, whole tensors) from the
    checkpoint at `path`, read on this process alone (no process group)."""
    record = read_record(path)
    metadata = dcp.FileSystemReader(path).read_metadata()
    wanted = {f"model.{f}" for f in record["keys"].values()} | {f"buffer.{f}" for f in record["keys"].values()}
    keys = wanted & set(metadata.state_dict_metadata)
    sd = _read_whole(path, keys)
    out = {}
    for key, fqn in record["keys"].items():
        value = sd.get(f"model.{fqn}", sd.get(f"buffer.{fqn}"))
        if value is None:
            shape = record["params"].get(fqn)
            if shape is None or math.prod(shape):
                raise ValueError(f"checkpoint {str(path)!r} has no tensor for {key!r}")
            value = torch.empty(shape)
        out[key] = value
    return out


__all__ = ["save", "load", "load_extra", "read_model", "read_record", "check_model", "create_state"]
