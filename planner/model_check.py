"""Is the model a plan was made for still that model? A plan distributes the graph captured
when it was planned (`Plan.graph`, its hash `ModelInfo.fingerprint`: every op, argument,
parameter name, shape and dtype; instruction_set.graph). Training it after the model file
(or the zoo) changed would train the old graph with the new model's initialisation and data,
or fail deep inside a rank; so a run captures the model again before any rank starts and
refuses a different one, naming the first difference. There is no override: re-plan.
"""

from __future__ import annotations

from typing import Any

from hetsynth.instruction_set.graph import Node, ReferenceGraph
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.instruction_set.plan import Plan
from hetsynth.planner.capture import capture_spec

# what the fingerprint leaves out (instruction_set.graph.ReferenceGraph.fingerprint)
UNHASHED = {"source", "flops_fwd", "flops_bwd", "measured_s", "saved"}
MAX_SHOWN = 120  # characters of a differing value shown
FIRST = ("op", "target", "fqn", "outputs", "args", "kwargs")  # named before the rest (a name follows its op)


class ModelChangedError(ValueError):
    """The model is not the one the plan was made for; the message names the first difference."""


def check_model_unchanged(plan: Plan) -> None:
    """ModelChangedError when the model `plan.model.ref` captures now to another graph than
    the plan's (ModelRefError / CaptureError when it no longer resolves or captures)."""
    spec = parse_model_ref(plan.model.ref)
    graph = capture_spec(spec, allow_replicate_fallback=bool(plan.graph.fallback_ops))
    if graph.fingerprint == plan.model.fingerprint:
        return
    raise ModelChangedError(f"model {plan.model.ref!r} changed since it was planned: "
                            f"{first_difference(plan.graph, graph)}; make a new plan (hetsynth plan) for it")


def first_difference(planned: ReferenceGraph, now: ReferenceGraph) -> str:
    """The first node (in graph order) that differs between two graphs, as text."""
    for i, (old, new) in enumerate(zip(planned.nodes, now.nodes)):
        fields = _differing(old, new)
        if fields:
            name, before, after = fields[0]
            return f"{_describe(i, old)}: {name} {_show(before)} in the plan, {_show(after)} now"
    if len(planned.nodes) != len(now.nodes):
        common = min(len(planned.nodes), len(now.nodes))
        extra = (now.nodes if len(now.nodes) > common else planned.nodes)[common]
        return (f"the graph has {len(now.nodes)} nodes, the plan's {len(planned.nodes)} (first unmatched: "
                f"{_describe(common, extra)})")
    return f"graph fingerprint {planned.fingerprint} in the plan, {now.fingerprint} now"


def _differing(old: Node, new: Node) -> list[tuple[str, Any, Any]]:
    a = old.model_dump(mode="json", exclude=UNHASHED)
    b = new.model_dump(mode="json", exclude=UNHASHED)
    keys = [*FIRST, *(k for k in a if k not in FIRST)]
    return [(k, _outputs(a[k]) if k == "outputs" else a[k], _outputs(b[k]) if k == "outputs" else b[k])
            for k in keys if a[k] != b[k]]


def _outputs(metas: list[dict]) -> str:
    """`(4, 8) float32` per output: the shape and dtype of each."""
    return ", ".join(f"{tuple(m['shape'])} {m['dtype']}" + ("" if m["requires_grad"] else " (no grad)") for m in metas)


def _describe(index: int, node: Node) -> str:
    if node.op in ("param", "buffer") and node.fqn:
        return f"{node.op} {node.fqn!r}"
    if node.op == "call":
        where = f" in {node.module_path}" if node.module_path else ""
        return f"node {index} ({node.target}{where})"
    return f"{node.op} {node.name!r}"


def _show(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."
