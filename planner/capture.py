"""Capture an nn.Module into the reference graph (instruction_set.graph).

1. `torch.export.export(..., strict=False)` in training mode gives an ATen graph in the
   training IR. The module's parameters, buffers and the example inputs are swapped for
   FakeTensors that claim the CPU (and restored afterwards): nothing is allocated, so a
   1.5B-parameter model built on the meta device captures in seconds, and a tensor the
   forward makes from Python values (`x[..., [-2]]`, `torch.tensor(0.5)`) keeps its value,
   which the graph carries as a constant (a meta tensor would have none).
2. planner.lower lowers it to the op surface: no_grad regions inlined (their outputs
   detached), cross-entropy and the normalisations decomposed, torch's core ATen
   decompositions applied except for the composites kept whole, in-place ops made functional
   and every buffer the forward mutates updated by an explicit `copy_(buffer, new)` node.
3. Every node is replayed on meta tensors: outputs give shapes, dtypes and whether a gradient
   flows; FlopCounterMode counts the forward FLOPs of the op and, through autograd on the
   op alone, its backward FLOPs. Counts are cached per (op, argument shapes), so repeated
   layers cost one count.
4. Ops without a sharding rule are collected, all of them, with their module path and source
   line (the first MAX_PLACES places of each, then how many more); they fail the capture
   unless `allow_replicate_fallback` accepts them as replicated-only ops. Higher-order ops
   that survive lowering (torch.cond, ...) carry subgraphs the plan cannot hold: they are
   reported and cannot fall back.
5. What training needs is checked here, at plan time, not on the ranks: at least one trainable
   (floating-point, requires_grad) parameter, and a loss that is one floating-point scalar
   through which gradients reach the parameters (not detached, not computed under no_grad).
6. A `torch.autograd.Function` subclass the forward applies (outside torch itself) is traced
   through its forward: the graph differentiates those ops, and the class's own backward never
   runs. Where that backward is the forward's derivative (bloom's GeLU) nothing changes; where
   it is not (a straight-through estimator, phimoe's sparsemixer router) the gradients differ
   from one device's. torch.export keeps no trace of it, so capture records the classes
   (`ReferenceGraph.custom_backwards`), logs a warning, and `hetsynth plan` and a failed
   `--check` name them.
7. A model of N >= block_capture.MIN_BLOCKS identical blocks is traced with 2, 3 and 4 of
   them and its graph assembled, node for node the graph of tracing all N (planner.block_capture:
   checked on 4 blocks); the whole model is traced where that does not apply.
"""

from __future__ import annotations

import json
import logging
import operator
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from hetsynth.instruction_set.args import decode_arg, encode_arg, refs_in
from hetsynth.instruction_set.graph import CUSTOM_BACKWARD, Node, ReferenceGraph, TensorMeta
from hetsynth.instruction_set.interpret import RUN_AS
from hetsynth.instruction_set.models import ModelSpec
from hetsynth.instruction_set.rules import is_supported
from hetsynth.instruction_set.rules.moe import flop_formulas
from hetsynth.planner.block_capture import NotReplicable, by_blocks, repeated_list, truncated
from hetsynth.planner.lower import Lowered, LoweringError, lower, place
from hetsynth.cost_models.saved_tensors import with_saved

META = torch.device("meta")
log = logging.getLogger(__name__)


class CaptureError(ValueError):
    """The model cannot be captured; the message says why and where."""


MAX_PLACES = 5  # places listed per unsupported op


class UnsupportedOpsError(CaptureError):
    def __init__(self, report: list["UnsupportedOp"]) -> None:
        self.report = report
        lines = [f"{len(report)} unsupported op kind(s) (no sharding rule):"]
        for op in report:
            lines.append(f"  {op.target} x{op.count}" + ("  (higher-order op: cannot fall back)" if op.higher_order else ""))
            lines += [f"      at {where}" for where in op.places[:MAX_PLACES]]
            if len(op.places) > MAX_PLACES:
                lines.append(f"      and {len(op.places) - MAX_PLACES} more")
        if all(not op.higher_order for op in report):
            lines.append("Re-run with --allow-replicate-fallback (API: allow_replicate_fallback=True) "
                         "to compute them replicated on every device.")
        else:
            lines.append("Higher-order ops (control flow, subgraphs) have no replicated fallback: "
                         "rewrite that part of the model without them.")
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class UnsupportedOp:
    target: str
    count: int
    places: tuple[str, ...]
    higher_order: bool = False


def target_name(target: Any) -> str:
    return "getitem" if target is operator.getitem else str(target)


def _meta_of(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=tuple(int(s) for s in t.shape), dtype=str(t.dtype).removeprefix("torch."),
                      requires_grad=bool(t.requires_grad))


@contextmanager
def _faked(model: nn.Module, mode: FakeTensorMode) -> Iterator[None]:
    """The module's parameters and buffers as FakeTensors on the CPU, restored on exit; a
    tensor registered in several places (a tied weight) gets one fake, so it stays tied."""
    saved: list[tuple[dict, str, Any]] = []
    fakes: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, value in table.items():
                if value is None:
                    continue
                saved.append((table, name, value))
                if id(value) not in fakes:
                    fake = _fake(mode, value)
                    fakes[id(value)] = nn.Parameter(fake, value.requires_grad) if isinstance(value, nn.Parameter) else fake
                table[name] = fakes[id(value)]
    try:
        yield
    finally:
        for table, name, value in saved:
            table[name] = value


def _fake(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    meta = t.detach() if t.is_meta else torch.empty_like(t.detach(), device=META)
    return FakeTensor(mode, meta, torch.device("cpu"))


@contextmanager
def _custom_functions(found: set[str]) -> Iterator[None]:
    """Adds to `found` every torch.autograd.Function subclass applied inside, torch's own aside
    (module docstring, 6)."""
    function = torch.autograd.Function
    original = function.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if not cls.__module__.startswith("torch."):
            found.add(f"{cls.__module__}.{cls.__qualname__}")
        return original.__func__(cls, *args, **kwargs)

    function.apply = classmethod(apply)  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        function.apply = original  # type: ignore[method-assign]


def _export(model: nn.Module, inputs: Sequence[torch.Tensor]) -> tuple[Lowered, tuple[str, ...]]:
    """The lowered training graph, and the custom autograd Functions the forward applied."""
    model.train()
    mode = FakeTensorMode()
    fake_inputs = tuple(_fake(mode, t) for t in inputs)
    custom: set[str] = set()
    try:
        with _faked(model, mode), mode, _custom_functions(custom):
            ep = torch.export.export(model, fake_inputs, strict=False)
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # export (or the forward: sys.exit too) raises many types; one capture error
        raise CaptureError(f"torch.export could not trace the model: {type(err).__name__}: {err}") from err
    try:
        return lower(ep), tuple(sorted(custom))
    except LoweringError as err:
        raise CaptureError(str(err)) from None


class _Replay:
    """Runs graph nodes one by one on meta tensors, counting FLOPs per node."""

    def __init__(self) -> None:
        self.env: dict[str, Any] = {}
        self.cache: dict[str, tuple[float, float]] = {}
        self.unreplayed: set[str] = set()  # nodes given export's shapes: whether a gradient flows is unknown

    def leaf(self, name: str) -> Any:
        value = self.env[name]
        if isinstance(value, (tuple, list)):
            return value
        return value.detach().requires_grad_(value.requires_grad)

    def run(self, target: Any, args: list, kwargs: dict, key: str) -> tuple[Any, float, float]:
        leaves: list[torch.Tensor] = []

        def resolve(name: str) -> Any:
            t = self.leaf(name)
            if isinstance(t, torch.Tensor):
                leaves.append(t)
            return t

        a = decode_arg(args, resolve, META)
        k = {n: decode_arg(v, resolve, META) for n, v in kwargs.items()}
        cached = self.cache.get(key)
        if cached is not None:
            with torch.no_grad() if not any(t.requires_grad for t in leaves) else _nullctx():
                return target(*a, **k), *cached
        with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as fwd:
            out = target(*a, **k)
        bwd = _backward_flops(out, [t for t in leaves if t.requires_grad])
        self.cache[key] = (float(fwd.get_total_flops()), bwd)
        return out, *self.cache[key]


class _nullctx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _backward_flops(out: Any, leaves: list[torch.Tensor]) -> float:
    outs = [t for t in (out if isinstance(out, (tuple, list)) else [out])
            if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outs or not leaves:
        return 0.0
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as bwd:
        torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs], allow_unused=True)
    return float(bwd.get_total_flops())


def _cache_key(target: str, args: list, kwargs: dict, replay: _Replay) -> str:
    def shape_of(name: str) -> Any:
        v = replay.env[name]
        if isinstance(v, torch.Tensor):
            return [list(v.shape), str(v.dtype), v.requires_grad]
        return name

    sub = lambda x: [sub(i) for i in x] if isinstance(x, list) else (
        shape_of(x["ref"]) if isinstance(x, dict) and "ref" in x else x)
    return json.dumps([target, sub(args), {k: sub(v) for k, v in kwargs.items()}], default=str)


MAX_CONSTANT = 4096  # elements of a constant kept in the graph


def _placeholder(node: fx.Node, kind: str, fqn: str, replay: _Replay, constants: dict[str, torch.Tensor]) -> Node:
    val = node.meta["val"]
    t = torch.empty(val.shape, dtype=val.dtype, device=META)
    t.requires_grad_(kind == "param" and t.is_floating_point())
    replay.env[node.name] = t
    if kind == "const":
        return Node(name=node.name, op="buffer", outputs=(_meta_of(t),), value=_constant_value(fqn, constants[node.name]))
    return Node(name=node.name, op=kind, fqn=fqn, outputs=(_meta_of(t),))


def _constant_value(fqn: str, value: torch.Tensor) -> Any:
    if isinstance(value, FakeTensor) or value.is_meta or value.numel() > MAX_CONSTANT:
        raise CaptureError(f"the forward makes a tensor {fqn!r} of shape {tuple(value.shape)} whose values "
                           f"the graph cannot keep (computed, or over {MAX_CONSTANT} elements); create it in "
                           "__init__ and register it as a buffer instead")
    return value.detach().cpu().tolist()


def _call(node: fx.Node, replay: _Replay) -> Node:
    name_of = lambda v: v.name if isinstance(v, fx.Node) else None
    args = [encode_arg(a, name_of) for a in node.args]
    kwargs = {k: encode_arg(v, name_of) for k, v in node.kwargs.items()}
    target = target_name(node.target)
    where = place(node)
    try:
        call = RUN_AS.get(target, node.target)  # a view as the runtime runs it: meta strides differ
        out, fwd, bwd = replay.run(call, args, kwargs, _cache_key(target, args, kwargs, replay))
    except Exception:  # op without a meta kernel: fall back to export's shapes, no FLOPs
        _check_not_a_number(node.meta.get("val"), target, where)
        out, fwd, bwd = _from_export_meta(node.meta.get("val")), 0.0, 0.0
        replay.unreplayed.add(node.name)
    replay.env[node.name] = out
    outs = out if isinstance(out, (tuple, list)) else [out]
    return Node(
        name=node.name, op="call", target=target, args=tuple(args), kwargs=kwargs,
        inputs=tuple(refs_in(args) + [r for v in kwargs.values() for r in refs_in(v)]),
        outputs=tuple(_meta_of(t) for t in outs if isinstance(t, torch.Tensor)),
        multi_output=isinstance(out, (tuple, list)), flops_fwd=fwd, flops_bwd=bwd,
        module_path=where[0], source=where[1],
    )


def _check_not_a_number(val: Any, target: str, where: tuple[str, str]) -> None:
    """A CaptureError for an op that turns a tensor into a Python number (`.item()`,
    `.tolist()`: export records a symbol for it): what follows depends on the batch's values."""
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
        raise CaptureError(f"{target} at {where[0] or 'the top level'} ({where[1]}) turns a tensor into a Python "
                           f"number ({val}): the shapes after it depend on the batch's values, and a plan needs "
                           "shapes the batch's shape fixes; keep such values in tensors (for mixture-of-experts "
                           "routing: per-expert masks, or torch's grouped matmul, instead of per-expert sizes)")


def _from_export_meta(val: Any) -> Any:
    if isinstance(val, (tuple, list)):
        return [_from_export_meta(v) for v in val]
    if val is None:
        raise CaptureError("an op produced no tensor metadata")
    return torch.empty(val.shape, dtype=val.dtype, device=META)


def _loss_name(outputs: list[str], nodes: list[Node]) -> str:
    metas = {n.name: n.outputs for n in nodes}
    first = metas.get(outputs[0]) if outputs else None
    if len(outputs) != 1 or not first or len(first) != 1 or first[0].shape != ():
        shape = [m.shape for m in first] if first else None
        raise CaptureError(f"forward must return one scalar loss; it returned {len(outputs)} "
                           f"value(s), the first of shape {shape}")
    return outputs[0]


def _check_trainable(model: nn.Module) -> None:
    """CaptureError unless the model has a parameter training can update."""
    params = list(model.parameters())
    if not params:
        raise CaptureError(f"the model ({type(model).__name__}) has no parameters: training would update "
                           f"nothing; register the weights as nn.Parameter (in __init__)")
    if not any(p.requires_grad and p.is_floating_point() for p in params):
        frozen = sum(p.numel() for p in params)
        raise CaptureError(f"the model ({type(model).__name__}) has no trainable parameters: its {len(params)} "
                           f"parameter tensor(s) ({frozen:,} elements) all have requires_grad=False or are not "
                           f"floating point")


def _check_loss(loss: str, nodes: list[Node], unreplayed: set[str]) -> None:
    """CaptureError unless the loss is a floating-point scalar that gradients flow through
    (known only when every node was replayed: export's shapes say nothing about gradients)."""
    meta = next(n for n in nodes if n.name == loss).outputs[0]
    if not meta.is_float:
        raise CaptureError(f"the loss has dtype {meta.dtype}; it must be a floating-point scalar to be "
                           f"differentiated (return e.g. loss.float(), computed from the parameters)")
    if not meta.requires_grad and not unreplayed:
        raise CaptureError(f"the loss ({meta.dtype} scalar) does not depend on any trainable parameter "
                           f"(it is detached, computed under torch.no_grad, or uses no parameter): training "
                           f"would change nothing")


def _unsupported(nodes: list[Node], higher_order: set[str]) -> list[UnsupportedOp]:
    bad = [n for n in nodes if n.op == "call" and not is_supported(n.target)]
    counts = Counter(n.target for n in bad)
    return [UnsupportedOp(t, c, tuple(f"{n.module_path or '<root>'}  ({n.source or 'no source line'})"
                                      for n in bad if n.target == t), t in higher_order)
            for t, c in counts.items()]


def capture_spec(spec: ModelSpec, *, allow_replicate_fallback: bool = False) -> ReferenceGraph:
    """Capture a resolved model reference (on the meta device)."""
    return capture(spec.build("meta"), spec.example_inputs("meta"), model_ref=spec.ref,
                   allow_replicate_fallback=allow_replicate_fallback)


def capture(model: nn.Module, example_inputs: Sequence[torch.Tensor], *, model_ref: str = "",
            allow_replicate_fallback: bool = False, by_block: bool = True) -> ReferenceGraph:
    """Export `model` with `example_inputs` and build its reference graph. With `by_block`, a
    model of N >= MIN_BLOCKS identical blocks is traced with 2, 3 and 4 of them and its graph
    assembled (planner.block_capture: the same graph, checked on 4 blocks); where that does not
    apply or the check fails, the whole model is traced."""
    found = repeated_list(model) if by_block else None
    if found is not None:
        path, blocks = found

        def trace(k: int) -> ReferenceGraph:
            with truncated(blocks, k):
                return capture(model, example_inputs, model_ref=model_ref,
                               allow_replicate_fallback=allow_replicate_fallback, by_block=False)

        try:
            return by_blocks(trace, path, len(blocks))
        except (NotReplicable, CaptureError) as err:
            log.info("capture by block of %s (%d blocks) not used, the whole model is traced: %s",
                     path, len(blocks), str(err).splitlines()[0])
    lowered, custom = _export(model, example_inputs)
    if custom:
        log.warning("%s applies torch.autograd.Function(s) %s: %s", model_ref, ", ".join(custom), CUSTOM_BACKWARD)
    _check_trainable(model)  # after export: a forward that cannot be traced is the first thing to fix
    replay, nodes, higher_order = _Replay(), [], set()
    for node in lowered.graph_module.graph.nodes:
        if node.op == "placeholder":
            nodes.append(_placeholder(node, *lowered.kinds[node.name], replay, lowered.constants))
        elif node.op == "call_function":
            nodes.append(_call(node, replay))
            if isinstance(node.target, torch._ops.HigherOrderOperator):
                higher_order.add(nodes[-1].target)
    loss = _loss_name(lowered.outputs, nodes)
    report = _unsupported(nodes, higher_order)
    if report and (not allow_replicate_fallback or higher_order & {r.target for r in report}):
        raise UnsupportedOpsError(report)
    _check_loss(loss, nodes, replay.unreplayed)
    fallback = {r.target for r in report}
    nodes = [n.model_copy(update={"fallback": True}) if n.target in fallback else n for n in nodes]
    return with_saved(ReferenceGraph(model_ref=model_ref, nodes=tuple(nodes), loss=loss,
                                     fallback_ops=tuple(sorted(fallback)), custom_backwards=custom))


def short_op(target: str) -> str:
    """'aten.linear.default' -> 'linear'."""
    parts = target.split(".")
    return parts[1] if len(parts) == 3 and parts[0] == "aten" else target


def summarize(graph: ReferenceGraph) -> dict[str, Any]:
    """Op counts by kind, parameters, FLOPs and fallback ops of a captured graph, as data."""
    calls = graph.calls
    fwd, bwd = graph.flops
    return {
        "model": graph.model_ref,
        "fingerprint": graph.fingerprint,
        "num_ops": len(calls),
        "op_counts": dict(Counter(short_op(n.target) for n in calls).most_common()),
        "num_params": graph.num_params,
        "param_tensors": len(graph.params),
        "flops_forward": fwd,
        "flops_backward": bwd,
        "flops_total": fwd + bwd,
        "inputs": {n.name: list(n.out.shape) for n in graph.nodes if n.op == "input"},
        "fallback_ops": {t: sum(1 for n in calls if n.target == t) for t in graph.fallback_ops},
    }
