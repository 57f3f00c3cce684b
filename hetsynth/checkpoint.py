"""Checkpoints that travel between plans, through torch.distributed.checkpoint (runtime.dcp).

    pm = hetsynth.parallelize(model, plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ...
    hetsynth.checkpoint.save("ckpt/step100", pm, opt, step=100, extra={"sched": sched.state_dict()})

    # later, under any plan of the same model (other world size, ratios, ZeRO stage, pipeline):
    step = hetsynth.checkpoint.load("ckpt/step100", pm, opt)     # on every rank
    sched.load_state_dict(hetsynth.checkpoint.load_extra("ckpt/step100")["sched"])

`save` and `load` are collective (every rank calls them); each rank writes and reads only
its own pieces. `save` writes a new directory and swaps it in once every rank has written:
an interrupted save leaves the previous checkpoint at `path` intact. `extra` should be the
same on every rank (one copy is kept). `load` works before the optimizer's first step (it creates the state first),
and refuses a checkpoint of another model with a ValueError naming the first differing
parameter before any tensor is read. `extra` is any picklable object (unpickled on
`load_extra`: load checkpoints you trust). `export` (and `hetsynth checkpoint export CKPT -o
model.safetensors`) writes the plain module's state dict, loadable with
`model.load_state_dict(..., strict=True)`, without a process group.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hetsynth.instruction_set.files import atomic_file
from hetsynth.runtime.dcp import load, load_extra, read_model, save

EXPORT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


def export_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The plain module's state dict from a checkpoint: whole tensors under its keys, tied
    names each their own tensor (safetensors refuses shared storage)."""
    state = read_model(path)
    seen: set[int] = set()
    out = {}
    for key, value in state.items():
        ptr = value.untyped_storage().data_ptr() if value.numel() else None
        out[key] = value.clone() if ptr in seen else value.contiguous()
        if ptr is not None:
            seen.add(ptr)
    return out


def export(path: str | Path, output: str | Path) -> dict[str, torch.Tensor]:
    """Write the checkpoint's model as `output`: safetensors for .safetensors, else torch.save
    of the plain state dict; atomically (a failed write leaves no partial file)."""
    suffix = Path(output).suffix
    if suffix not in EXPORT_SUFFIXES:
        raise ValueError(f"-o {str(output)!r}: give a .safetensors or .pt file")
    state = export_state_dict(path)
    with atomic_file(output) as f:
        if suffix == ".safetensors":
            from safetensors.torch import save as to_bytes

            f.write(to_bytes(state, metadata={"format": "pt"}))
        else:
            torch.save(state, f)
    return state


__all__ = ["save", "load", "load_extra", "export", "export_state_dict"]
