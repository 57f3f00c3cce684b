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
twin's graph says. An op with no float64 kernel (torch._grouped_mm, which transformers' MoE
layers call, takes float32, bfloat16 or float16 only) is tried in float64 once, then runs in
float32 on converted inputs, its results converted back; `lowered_ops_recorded()` collects
which ops did, so a check can name them and judge at float32's precision (runtime.check).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hetsynth.instruction_set.graph import Node, TensorMeta
from hetsynth.instruction_set.plan import Plan

log = logging.getLogger(__name__)

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
    """The plan with its floating-point tensors in `target` (float64, float32, ...), computing
    in `target` everywhere: a twin has no mixed-precision policy (it checks the program)."""
    if target not in FLOATS:
        raise ValueError(f"dtype {target!r} is not a floating-point type; use one of {', '.join(FLOATS)}")
    graph = plan.graph.model_copy(update={"nodes": tuple(_node(n, target) for n in plan.graph.nodes)})
    return plan.model_copy(update={"graph": graph, "model": plan.model.model_copy(update={"dtype": target}),
                                   "precision": None})


# The open lowered_ops_recorded() blocks: each collects {op: dtype it ran in}.
_RECORDS: list[dict[str, str]] = []
_COMPLEX = {torch.float32: torch.complex64, torch.float64: torch.complex128}


class _FloatEverywhere(TorchDispatchMode):
    def __init__(self, dtype: torch.dtype, fallback: torch.dtype) -> None:
        super().__init__()
        self.dtype, self.fallback = dtype, fallback
        # ops found to have no kernel in `dtype` inside this block only: a process-wide memory
        # would carry one run's finding into every later run in the same process
        self.no_kernel: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        asked = kwargs.get("dtype")
        if isinstance(asked, torch.dtype) and asked.is_floating_point and asked != self.dtype:
            kwargs = {**kwargs, "dtype": self.dtype}
        if str(func) in self.no_kernel:
            return self._lowered(func, args, kwargs)
        try:
            return func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as err:
            if func._schema.is_mutable or not _only(self.dtype, (args, kwargs)) or self.fallback == self.dtype:
                raise  # mixed dtypes fail for another reason, which casting down would hide
            try:  # no kernel in this dtype, or a real error: the lower dtype tells which
                out = self._lowered(func, args, kwargs)
            except Exception:
                raise err from None
            self.no_kernel.add(str(func))
            log.info("%s has no %s kernel: it runs in %s, its results converted", func,
                     str(self.dtype).removeprefix("torch."), str(self.fallback).removeprefix("torch."))
            return out

    def _lowered(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """`func` on its inputs converted down to the fallback dtype, its results converted back."""
        down = {self.dtype: self.fallback}
        if self.dtype in _COMPLEX and self.fallback in _COMPLEX:
            down[_COMPLEX[self.dtype]] = _COMPLEX[self.fallback]
        out = func(*_cast(args, down), **_cast(kwargs, down))
        for record in _RECORDS:
            record[str(func)] = str(self.fallback).removeprefix("torch.")
        return _cast(out, {v: k for k, v in down.items()})


def _cast(value: Any, dtypes: dict[torch.dtype, torch.dtype]) -> Any:
    """Tensors in nested tuples, lists and dicts converted by `dtypes` (others kept)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtypes[value.dtype]) if value.dtype in dtypes else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtypes) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtypes) for k, v in value.items()}
    return dtypes.get(value, value) if isinstance(value, torch.dtype) else value


def _only(dtype: torch.dtype, value: Any) -> bool:
    """Whether the arguments hold a floating-point (or complex) tensor and every one of them
    is of `dtype` (or its complex counterpart): only then is a failure a missing kernel."""
    found = list(_inexact(value))
    return bool(found) and all(t in (dtype, _COMPLEX.get(dtype)) for t in found)


def _inexact(value: Any) -> Iterator[torch.dtype]:
    """The dtypes of the floating-point and complex tensors in nested arguments."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            yield value.dtype
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _inexact(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _inexact(v)


@contextmanager
def float_everywhere(dtype: str, fallback: str = "float32") -> Iterator[None]:
    """Run with every floating-point dtype an op is asked for, and the default, in `dtype`.
    An op without a kernel in `dtype` (it raises there, and runs on its inputs converted to
    `fallback`: torch._grouped_mm, float32-only custom ops) runs in `fallback`, its results
    converted to `dtype`; lowered_ops_recorded() says which ops did."""
    target = getattr(torch, dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(target)
    try:
        with _FloatEverywhere(target, getattr(torch, fallback)):
            yield
    finally:
        torch.set_default_dtype(previous)


@contextmanager
def lowered_ops_recorded() -> Iterator[dict[str, str]]:
    """{op: the dtype it ran in} for every op float_everywhere ran in its fallback dtype
    inside the block (the precision a check of that run can ask for follows the lowest)."""
    record: dict[str, str] = {}
    _RECORDS.append(record)
    try:
        yield record
    finally:
        _RECORDS.remove(record)
