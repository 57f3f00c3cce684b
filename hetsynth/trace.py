"""A plan's predicted step as a Chrome trace (`hetsynth trace plan.json -o predicted.json`).

The trace is in the Trace Event Format (the JSON object form: `traceEvents`, `otherData`),
which Perfetto and chrome://tracing load: one process (pid) per device, named
`rank i: <device> (<kind>)`, with lanes (tid) for compute, communication and waiting. Every
slice is an "X" (complete) event, times in microseconds from the start of the step, named
after its instruction and op (`instruction_name`, shared with the measured trace), with the
instruction's index, kind, variant, bytes and predicted seconds in its args.

The time axis is the step model's (planner.evaluate): instructions are bulk-synchronous, so
instruction k starts on every device when the slowest device finished instruction k-1,

    start_k = sum_{j<k} max_i t_j(i),     step time = start_K + the step's scalar all-reduces,

where t_j(i) is device i's predicted time of instruction j at the plan's shard lengths (an
instruction's time covers its forward and its backward: the cost model charges both). A
compute slice on device i lasts t_j(i); the rest of max_i t_j(i) is a `wait` slice naming the
slowest device. A collective lasts max_i t_j(i) on every device (it ends together). So the
compute lane of device i sums to the plan's predicted compute of device i and the
communication lane to the plan's predicted communication; `predicted_instructions` checks
this against the figures recorded in the plan and refuses a plan whose prediction this
cost model does not reproduce.

We write the events ourselves: torch.profiler writes traces only of what it profiled, and
the format is a small JSON schema (TRACE_SCHEMA, used by the tests).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from cost_models.terms import Cost, Form, seconds
from instruction_set.plan import Plan, PlanError
from instruction_set.program import Instruction

COMPUTE, COMMUNICATION, WAIT, PHASES = 1, 2, 3, 4
LANES = {COMPUTE: "compute", COMMUNICATION: "communication", WAIT: "wait", PHASES: "step phases"}
STEP_SCALARS = "step: scalar all-reduces (gradient norm, loss)"
US = 1e6
TOLERANCE = 1e-9  # relative, for the totals against the plan's figures


@dataclass(frozen=True)
class InstructionTimes:
    """One instruction's predicted seconds: per device, and its share of the step."""

    index: int | None        # None: the step's scalar all-reduces (no instruction of the program)
    name: str
    lane: int                # COMPUTE or COMMUNICATION
    per_device: tuple[float, ...]
    step_s: float            # max over devices: what the instruction adds to the step time
    args: dict[str, Any] = field(default_factory=dict)


def short_op(target: str) -> str:
    """'aten.mm.default' -> 'mm'."""
    parts = target.split(".")
    if len(parts) >= 2 and parts[0] == "aten":
        return parts[1]
    return target or "op"


def instruction_name(plan: Plan, index: int) -> str:
    """The slice name of instruction `index`, in predicted and measured traces alike."""
    ins = plan.instructions[index]
    if ins.kind == "compute":
        return f"{short_op(plan.graph.node(ins.node).target)} {ins.node}"
    if ins.kind == "param":
        return f"update {ins.tensor}"
    if ins.kind == "sfb":
        return f"sfb {ins.tensor} [{ins.variant}]"
    return ins.describe()


def lane_of(ins: Instruction) -> int:
    return COMPUTE if ins.kind in ("compute", "param") else COMMUNICATION


def instruction_args(plan: Plan, index: int, nbytes: float) -> dict[str, Any]:
    ins = plan.instructions[index]
    args: dict[str, Any] = {"instruction": index, "kind": ins.kind, "tensor": ins.tensor, "layout": str(ins.layout),
                            "bytes": nbytes, "predicted_s": ins.predicted_s}
    if ins.kind == "compute":
        args["op"] = plan.graph.node(ins.node).target
    if ins.src is not None:
        args["src"] = str(ins.src)
    if ins.variant:
        args["variant"] = ins.variant
    if ins.phase == "backward":
        args["phase"] = "backward"
    if ins.axis != "all":
        args["axis"] = ins.axis
    return args


def plan_digest(plan: Plan) -> str:
    """Identifies a plan: a measured trace is only compared with the plan that was run."""
    text = json.dumps(plan.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def predicted_instructions(plan: Plan) -> list[InstructionTimes]:
    """Every costed instruction's predicted seconds per device, in program order, then the
    step's scalar all-reduces; checked against the plan's recorded prediction."""
    from planner.evaluate import first_input_layouts, instruction_term, step_term
    from planner.problem import Problem, Restrictions

    pb = Problem(plan.graph, plan.cluster, plan.sharding_ratios, Restrictions(two_level=plan.mesh.two_level))
    expand, x_layouts, out = pb.devices.expand, first_input_layouts(plan.instructions), []
    for index, ins in enumerate(plan.instructions):
        term = instruction_term(pb, ins, x_layouts)
        if term is None:
            continue
        per_class = _per_class_seconds(term.time, plan, index)
        out.append(InstructionTimes(index, instruction_name(plan, index), lane_of(ins), expand(per_class),
                                    max(per_class), instruction_args(plan, index, pb.meta(ins.tensor).nbytes)))
    step = step_term(pb)
    step_s = seconds(step.time)
    out.append(InstructionTimes(None, STEP_SCALARS, COMMUNICATION, (step_s,) * plan.cluster.num_devices, step_s,
                                {"predicted_s": step_s}))
    _check_totals(plan, out)
    return out


def _per_class_seconds(cost: Cost, plan: Plan, index: int) -> list[float]:
    """Seconds of each device class of an instruction that is one bulk-synchronous form (every
    instruction of today's plans); an instruction whose work overlaps is refused, naming it."""
    if not isinstance(cost, Form):
        raise ValueError(f"instruction {index} ({instruction_name(plan, index)}): its cost is a "
                         f"{type(cost).__name__} of forms; the trace lays out one form per instruction")
    values = cost.cost.per_device(cost.shares.values)
    return values if cost.devices is None else [values[i] if i in cost.devices else 0.0 for i in range(len(values))]


def device_totals(times: list[InstructionTimes], num_devices: int) -> tuple[list[float], float]:
    """(compute seconds of each device, communication seconds) of a step."""
    compute = [sum(t.per_device[i] for t in times if t.lane == COMPUTE) for i in range(num_devices)]
    return compute, sum(t.step_s for t in times if t.lane == COMMUNICATION)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(abs(a), abs(b), 1e-12)


def _check_totals(plan: Plan, times: list[InstructionTimes]) -> None:
    p = plan.predicted
    compute, comm = device_totals(times, plan.cluster.num_devices)
    step = sum(t.step_s for t in times)
    bad = [f"step time {step:.6g} s vs {p.step_time_s:.6g} s"] if not _close(step, p.step_time_s) else []
    bad += [f"{d.name} compute {c:.6g} s vs {d.compute_s:.6g} s" for c, d in zip(compute, p.devices)
            if not _close(c, d.compute_s)]
    bad += [f"communication {comm:.6g} s vs {p.communication_s:.6g} s"] if not _close(comm, p.communication_s) else []
    if bad:
        raise PlanError(f"this hetsynth's cost model does not reproduce the plan's prediction ({'; '.join(bad[:3])}): "
                        f"the plan was made by another version or with other figures; make it again with "
                        f"`hetsynth plan`")


def complete(name: str, pid: int, tid: int, start_s: float, dur_s: float, args: dict[str, Any]) -> dict[str, Any]:
    """An "X" event; times in seconds in, microseconds out."""
    return {"name": name, "cat": LANES[tid], "ph": "X", "pid": pid, "tid": tid, "ts": start_s * US,
            "dur": max(dur_s, 0.0) * US, "args": args}


def process_events(plan: Plan, lanes: tuple[int, ...]) -> list[dict[str, Any]]:
    """Metadata events: a named process per device, a named thread per lane."""
    out: list[dict[str, Any]] = []
    for rank, device in enumerate(plan.cluster.devices):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"name": f"rank {rank}: {device.name} ({device.kind})"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        out += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": LANES[tid]}}
                for tid in lanes]
    return out


def _slices(plan: Plan, t: InstructionTimes, start_s: float) -> list[dict[str, Any]]:
    devices = plan.cluster.devices
    slowest = max(range(len(devices)), key=lambda i: t.per_device[i])
    out = []
    for rank, busy in enumerate(t.per_device):
        if t.lane == COMMUNICATION:
            out.append(complete(t.name, rank, COMMUNICATION, start_s, t.step_s, t.args))
            continue
        out.append(complete(t.name, rank, COMPUTE, start_s, busy, {**t.args, "device_s": busy}))
        if t.step_s - busy > TOLERANCE * t.step_s:
            out.append(complete(f"wait for {devices[slowest].name}", rank, WAIT, start_s + busy, t.step_s - busy,
                                {"instruction": t.index, "waits_for": devices[slowest].name}))
    return out


def trace_document(plan: Plan, kind: str, events: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"hetsynth": kind, "model": plan.model.ref, "cluster": plan.cluster.name,
                          "plan_digest": plan_digest(plan), **extra}}


def predicted_trace(plan: Plan) -> dict[str, Any]:
    """The predicted step of `plan` as a Chrome trace (module docstring)."""
    events = process_events(plan, (COMPUTE, COMMUNICATION, WAIT))
    start = 0.0
    for t in predicted_instructions(plan):
        events += _slices(plan, t, start)
        start += t.step_s
    return trace_document(plan, "predicted", events, step_time_s=plan.predicted.step_time_s)


TRACE_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "Chrome Trace Event Format (JSON object form), the events hetsynth writes",
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "traceEvents": {"type": "array", "items": {"$ref": "#/$defs/event"}},
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "otherData": {"type": "object"},
    },
    "$defs": {
        "event": {
            "type": "object",
            "required": ["name", "ph", "pid", "tid"],
            "properties": {
                "name": {"type": "string"},
                "cat": {"type": "string"},
                "ph": {"enum": ["B", "E", "X", "i", "I", "C", "M", "b", "e", "n", "s", "t", "f", "P", "O", "N", "D"]},
                "pid": {"type": "integer", "minimum": 0},
                "tid": {"type": "integer", "minimum": 0},
                "ts": {"type": "number", "minimum": 0, "description": "microseconds"},
                "dur": {"type": "number", "minimum": 0, "description": "microseconds"},
                "args": {"type": "object"},
            },
            "allOf": [
                {"if": {"properties": {"ph": {"const": "X"}}}, "then": {"required": ["ts", "dur"]}},
                {"if": {"properties": {"ph": {"const": "M"}}},
                 "then": {"properties": {"name": {"enum": ["process_name", "process_labels", "process_sort_index",
                                                           "thread_name", "thread_sort_index"]}},
                          "required": ["args"]}},
                {"if": {"properties": {"ph": {"enum": ["B", "E", "i", "I", "C"]}}}, "then": {"required": ["ts"]}},
            ],
        },
    },
}
