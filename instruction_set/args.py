"""JSON encoding of the non-tensor arguments of graph nodes.

The reference graph and plans are plain data: an fx argument is encoded as JSON, with tagged
objects for what JSON lacks. Tensor arguments become `{"ref": node_name}`.

    fx.Node           -> {"ref": "linear_3"}
    torch.dtype       -> {"dtype": "float32"}
    torch.device      -> {"device": "cpu"}
    torch.layout      -> {"layout": "strided"}
    torch.memory_format -> {"memory_format": "contiguous_format"}
    inf / nan         -> {"float": "inf"}
    list / tuple      -> list
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

Encoded = Any


def encode_arg(value: Any, node_name: Callable[[Any], str | None]) -> Encoded:
    """Encode one fx argument; `node_name(v)` returns a node's name or None for non-nodes."""
    name = node_name(value)
    if name is not None:
        return {"ref": name}
    if isinstance(value, (list, tuple)):
        return [encode_arg(v, node_name) for v in value]
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": str(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot encode argument {value!r} of type {type(value).__name__}")


def decode_arg(value: Encoded, resolve: Callable[[str], Any], device: torch.device | None = None) -> Any:
    """Inverse of encode_arg. `resolve(name)` gives the value of a referenced node; a `device`
    argument, when given, replaces every encoded device (graphs are captured on meta)."""
    if isinstance(value, list):
        return [decode_arg(v, resolve, device) for v in value]
    if not isinstance(value, dict):
        return value
    (tag, payload), = value.items()
    if tag == "ref":
        return resolve(payload)
    if tag == "dtype":
        return getattr(torch, payload)
    if tag == "device":
        return device if device is not None else torch.device(payload)
    if tag in ("layout", "memory_format"):
        return getattr(torch, payload)
    if tag == "float":
        return float(payload)
    raise ValueError(f"unknown encoded argument tag {tag!r}")


def refs_in(value: Encoded) -> list[str]:
    """Names of the nodes referenced by an encoded argument, in order, with repeats."""
    if isinstance(value, list):
        return [r for v in value for r in refs_in(v)]
    if isinstance(value, dict) and "ref" in value:
        return [value["ref"]]
    return []
