"""A plan's twin in another floating-point precision: the same program, another dtype.

`with_float_dtype(plan, "float64")` is the plan with every floating-point tensor of its
reference graph, and every dtype argument naming a floating-point type (conversions,
factories), in float64 (complex in complex128). Instructions, ratios, shard lengths and
predictions are unchanged, so the twin runs exactly the plan's distributed program with less
rounding: `hetsynth run --check` compares it with single-device training at a tight
tolerance, which a float32 run cannot meet (see runtime.check).

Models may ask for a precision explicitly (HuggingFace computes RMSNorm, rotary embeddings
and the loss in float32: `x.float()`). `float_everywhere("float64")` runs code with every
floating-point dtype an op is asked for turned into float64 (a TorchDispatchMode, below
autograd, so the backward follows) and float64 as the default dtype: the twin's ranks and the
single-device reference both train under it, so both compute everything in float64, as the
twin's graph says.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from instruction_set.graph import Node, TensorMeta
from instruction_set.plan import Plan

FLOATS = ("float16", "bfloat16", "float32", "float64")
COMPLEX = ("complex64", "complex128")


def _convert(dtype: str, target: str) -> str:
    if dtype in FLOATS:
        return target
    if dtype in COMPLEX:
        return "complex128" if target == "float64" else dtype
    return dtype


def _arg(value: Any, target: str) -> Any:
    if isinstance(value, list):
        return [_arg(v, target) for v in value]
    if isinstance(value, dict) and set(value) == {"dtype"}:
        return {"dtype": _convert(value["dtype"], target)}
    return value


def _node(node: Node, target: str) -> Node:
    outputs = tuple(TensorMeta(shape=m.shape, dtype=_convert(m.dtype, target), requires_grad=m.requires_grad)
                    for m in node.outputs)
    return node.model_copy(update={"outputs": outputs, "args": tuple(_arg(list(node.args), target)),
                                   "kwargs": {k: _arg(v, target) for k, v in node.kwargs.items()}})


def with_float_dtype(plan: Plan, target: str) -> Plan:
    """The plan with its floating-point tensors in `target` (float64, float32, ...)."""
    if target not in FLOATS:
        raise ValueError(f"dtype {target!r} is not a floating-point type; use one of {', '.join(FLOATS)}")
    graph = plan.graph.model_copy(update={"nodes": tuple(_node(n, target) for n in plan.graph.nodes)})
    return plan.model_copy(update={"graph": graph, "model": plan.model.model_copy(update={"dtype": target})})


class _FloatEverywhere(TorchDispatchMode):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        asked = kwargs.get("dtype")
        if isinstance(asked, torch.dtype) and asked.is_floating_point and asked != self.dtype:
            kwargs = {**kwargs, "dtype": self.dtype}
        return func(*args, **kwargs)


@contextmanager
def float_everywhere(dtype: str) -> Iterator[None]:
    """Run with every floating-point dtype an op is asked for, and the default, in `dtype`."""
    target = getattr(torch, dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(target)
    try:
        with _FloatEverywhere(target):
            yield
    finally:
        torch.set_default_dtype(previous)
