"""`hetsynth checkpoint ACTION`: commands on checkpoints written by hetsynth.checkpoint.save.

    hetsynth checkpoint export CKPT -o model.safetensors    (or -o model.pt: torch.save)

writes the plain module's state dict (whole tensors under its own keys, tied names and buffers
included), read without a process group: `model.load_state_dict(load_file(path), strict=True)`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hetsynth.runtime.outputs import check_outputs


def checkpoint_args(p: argparse.ArgumentParser) -> None:
    """work with a checkpoint written by hetsynth.checkpoint.save (export it for HF and friends)"""
    actions = p.add_subparsers(dest="action", required=True)
    export = actions.add_parser("export", help="write the plain module's state dict (.safetensors or .pt)")
    export.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory written by hetsynth.checkpoint.save")
    export.add_argument("-o", "--output", required=True, help="model.safetensors, or model.pt for torch.save")


def _inputs(checkpoint: str) -> dict[str, str | Path | None]:
    """The checkpoint directory and every file in it: an output must not overwrite any."""
    path = Path(checkpoint)
    files = sorted(path.iterdir()) if path.is_dir() else []
    return {"CKPT": path} | {f"CKPT file {f.name!r}": f for f in files}


def checkpoint_run(args: argparse.Namespace) -> int:
    from hetsynth.checkpoint import EXPORT_SUFFIXES, export

    output = check_outputs({"-o": args.output}, inputs=_inputs(args.checkpoint))["-o"]
    if output.suffix not in EXPORT_SUFFIXES:
        raise ValueError(f"-o {args.output!r}: give a .safetensors or .pt file")
    if not Path(args.checkpoint).is_dir():
        raise ValueError(f"CKPT {args.checkpoint!r}: not a checkpoint directory")
    state = export(args.checkpoint, output)
    count = sum(v.numel() for v in state.values())
    print(f"wrote {args.output}: {len(state)} tensors, {count:,} elements")
    return 0


COMMANDS = {"checkpoint": (checkpoint_args, checkpoint_run)}
