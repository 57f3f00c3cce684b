"""A plan's predicted step as a Chrome trace (`hetsynth trace plan.json -o predicted.json`).

The trace is in the Trace Event Format (the JSON object form: `traceEvents`, `otherData`),
which Perfetto and chrome://tracing load: one process (pid) per device, named
`rank i: <device> (<kind>)`, with lanes (tid) for compute, communication and waiting. Every
slice is an "X" (complete) event, times in microseconds from the start of the step, named
after its instruction and op (`instruction_name`, shared with the measured trace), with the
instruction's index, kind, variant, bytes and predicted seconds in its args.

The time axis is the step model's (planner.step_cost): instructions are bulk-synchronous, so
an instruction starts on every device when the slowest device finished the one before. The
step runs the forward halves of the instructions in program order, their backward halves in
reverse order, the parameter updates, then the step's scalar all-reduces:

    forward   f_k(i) = phi_k t_k(i)          (phi_k: forward share, step_cost.forward_share)
    backward  c_k(i) = (1 - phi_k) t_k(i)    k = N..1
    bucket b  starts at max(e_{b-1}, R_b), ends e_b = start + S_b   (on its own lane)

where t_k(i) is device i's predicted time of instruction k at the plan's shard lengths, R_b the
time the backward has passed the first use of bucket b's parameters, S_b its all-reduce. The
gradient buckets' all-reduces run on the "gradient sync" lane beside the backward; what of them
is left after the backward (e_B minus the backward's end) is a "wait for gradient sync" slice
on the communication lane. A compute slice on device i lasts its own time; the rest of the
slowest device's is a `wait` slice naming it. A collective lasts the slowest device's time on
every device. So the compute lane of device i sums to the plan's predicted compute of device i,
the communication lane to the plan's exposed communication and the end to the step time;
`predicted_step` checks this against the figures recorded in the plan and refuses a plan whose
prediction this cost model does not reproduce.

We write the events ourselves: torch.profiler writes traces only of what it profiled, and
the format is a small JSON schema (TRACE_SCHEMA, used by the tests).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from hetsynth.cost_models.terms import Cost, Form, Series, busy, exposed, seconds
from hetsynth.instruction_set.kinds import Category
from hetsynth.instruction_set.plan import Plan, PlanError
from hetsynth.instruction_set.program import FUSED_MATMULS, Instruction
from hetsynth.instruction_set.training_state import TrainingState

COMPUTE, COMMUNICATION, WAIT, PHASES, GRADIENT_SYNC = 1, 2, 3, 4, 5
LANES = {COMPUTE: "compute", COMMUNICATION: "communication", WAIT: "wait", PHASES: "step phases",
         GRADIENT_SYNC: "gradient sync (overlapped)"}
STEP_SCALARS = "step: scalar all-reduces (gradient norm)"
SYNC_WAIT = "wait for gradient sync"
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


@dataclass(frozen=True)
class Placed:
    """`share` of an instruction's seconds (its forward or backward half, or all of it), run
    from `start_s` on every device."""

    times: InstructionTimes
    start_s: float
    share: float


@dataclass(frozen=True)
class Bucket:
    """A gradient bucket's all-reduce on the gradient sync lane."""

    name: str
    ready_s: float
    start_s: float
    seconds: float
    args: dict[str, Any]


@dataclass(frozen=True)
class PredictedStep:
    """The predicted step laid out in time (module docstring)."""

    instructions: list[InstructionTimes]  # whole instructions in program order, then the scalars
    placed: list[Placed]
    buckets: list[Bucket]
    sync_wait: tuple[float, float]        # (start, seconds) of the wait for the buckets
    step_s: float


def predicted_instructions(plan: Plan) -> list[InstructionTimes]:
    """Every costed instruction's predicted seconds per device (forward and backward), in
    program order, then the step's scalar all-reduces; checked against the plan's prediction."""
    return predicted_step(plan).instructions


def predicted_step(plan: Plan) -> PredictedStep:
    """The plan's step laid out as the cost model sees it; checked against its prediction."""
    from hetsynth.planner.evaluate import first_input_layouts, instruction_term
    from hetsynth.planner.problem import plan_problem
    from hetsynth.planner.step_cost import backward_share, forward_share, is_bucketed, scalar_terms, state_gather_terms

    pb = plan_problem(plan)
    expand, x_layouts, times = pb.devices.expand, first_input_layouts(plan.instructions), {}
    fused: dict[int, tuple[list[InstructionTimes], list[InstructionTimes]]] = {}
    for index, ins in enumerate(plan.instructions):
        term = None if is_bucketed(ins) else instruction_term(pb, ins, x_layouts)
        if term is not None and ins.kind in FUSED_MATMULS:
            args = instruction_args(plan, index, pb.meta(ins.tensor).nbytes)
            fused[index] = _fused_times(term.time, plan, index, pb, args)
        elif term is not None:
            per_class = _per_class_seconds(term.time, plan, index)
            times[index] = InstructionTimes(index, instruction_name(plan, index), lane_of(ins), expand(per_class),
                                            max(per_class), instruction_args(plan, index, pb.meta(ins.tensor).nbytes))
    share = {i: forward_share(pb, plan.instructions[i]) for i in times}
    gathers = _zero3_times(plan, pb)  # ZeRO-3: index of the param -> (its forward gathers, its backward)

    def pieces(i: int, forward: bool) -> list[tuple[InstructionTimes, float]]:
        """Instruction i's pieces in the forward (or the backward) pass, with their shares:
        a ZeRO-3 gather, a fused instruction's ring steps, or the plain instruction."""
        half = 0 if forward else 1
        if i in gathers:
            return [(gathers[i][half], 1.0)]
        if i in fused:
            return [(f, 1.0) for f in fused[i][half]]
        if i in times and plan.instructions[i].kind != "param":
            return [(times[i], share[i] if forward else backward_share(pb, plan.instructions[i]))]
        return []

    placed, t = _place([x for i in range(len(plan.instructions)) for x in pieces(i, True)], 0.0)
    done: dict[int, float] = {}
    for i in range(len(plan.instructions) - 1, -1, -1):
        more, t = _place(pieces(i, False), t)
        placed += more
        done[i] = t
    buckets = _buckets(plan, pb, done)
    more, t = _place([(x, 1.0) for x in _transfer_cpu_times(plan, pb)], t)
    placed += more
    sync_wait = (t, max(max((b.start_s + b.seconds for b in buckets), default=0.0) - t, 0.0))
    updates, t = _place([(times[i], 1.0) for i in times if plan.instructions[i].kind == "param"], t + sync_wait[1])
    scalars = [_scalar_times(term, plan.cluster.num_devices)
               for term in state_gather_terms(pb, plan.instructions) + scalar_terms(pb, plan.instructions)]
    tail, t = _place([(s, 1.0) for s in scalars], t)
    extra = [x for pair in gathers.values() for x in pair] + [x for i in sorted(fused) for half in fused[i] for x in half]
    step = PredictedStep(list(times.values()) + extra + scalars, placed + updates + tail, buckets, sync_wait, t)
    _check_totals(plan, step)
    return step


def _zero3_times(plan: Plan, pb: Any) -> dict[int, tuple[InstructionTimes, InstructionTimes]]:
    """Each ZeRO-3 parameter's gathers at its uses (forward) and regathers with reduce-scatters
    (backward), at the param instruction's place (planner.step_cost.zero3_all_forms)."""
    from hetsynth.planner.step_cost import zero3_all_forms

    forms, out = zero3_all_forms(pb, plan.instructions), {}
    for index, ins in enumerate(plan.instructions):
        if ins.kind == "param" and ins.state == TrainingState.ZERO3:
            nbytes = pb.meta(ins.tensor).nbytes
            args = {**instruction_args(plan, index, nbytes), "variant": plan.state_shards.variant}
            pair = []
            for form, what in zip(forms[ins.tensor],
                                  ("all_gather (ZeRO-3, each use)", "all_gather + reduce_scatter (ZeRO-3, backward)")):
                per_class = _per_class_seconds(form, plan, index)
                pair.append(InstructionTimes(index, f"{what} {ins.tensor}", COMMUNICATION,
                                             tuple(pb.devices.expand(per_class)), max(per_class), args))
            out[index] = (pair[0], pair[1])
    return out


def _place(items: list[tuple[InstructionTimes, float]], start_s: float) -> tuple[list[Placed], float]:
    """Run `items` (times, share) one after the other from `start_s`; (placed, end)."""
    out = []
    for times, share in items:
        if share > 0.0:
            out.append(Placed(times, start_s, share))
            start_s += share * times.step_s
    return out, start_s


def _buckets(plan: Plan, pb: Any, done: dict[int, float]) -> list[Bucket]:
    """The buckets' all-reduces: bucket b is ready when the backward has passed its parameters'
    first use (done[p_b]) and starts when the bucket before it has ended."""
    from hetsynth.planner.step_cost import bucket_sync, ready_indices

    buckets = plan.buckets()
    out, end = [], 0.0
    for n, (bucket, ready) in enumerate(zip(buckets, ready_indices(plan.instructions, buckets))):
        s, ready_s = seconds(bucket_sync(pb, bucket)), done.get(ready, 0.0)
        args = {"bucket": n, "bytes": bucket.nbytes, "variant": bucket.variant, "axis": str(bucket.axis),
                "predicted_s": s, "ready_s": ready_s}
        out.append(Bucket(f"gradient bucket {n} {bucket.kind}", ready_s, max(end, ready_s), s, args))
        end = max(end, ready_s) + s
    return out


def _transfer_cpu_times(plan: Plan, pb: Any) -> list[InstructionTimes]:
    """The compute each bucket's transfer takes from each device (planner.step_cost.TransferCpu),
    laid after the backward's compute as the cost model's whole-backward branch adds it."""
    from hetsynth.planner.step_cost import transfer_losses

    out = []
    for n, lost in enumerate(transfer_losses(pb, plan.buckets())):
        if lost is not None:
            per_class = lost.cost.per_device(lost.shares.values)
            out.append(InstructionTimes(None, f"transfer CPU of gradient bucket {n}", COMPUTE,
                                        pb.devices.expand(per_class), max(per_class),
                                        {"bucket": n, "predicted_s": max(per_class)}))
    return out


def _scalar_times(term: Any, n: int) -> InstructionTimes:
    s = seconds(term.time)
    return InstructionTimes(None, STEP_SCALARS, COMMUNICATION, (s,) * n, s, {"predicted_s": s})


def _fused_times(cost: Cost, plan: Plan, index: int, pb: Any,
                 args: dict[str, Any]) -> tuple[list[InstructionTimes], list[InstructionTimes]]:
    """A fused instruction's (forward, backward) pieces (planner.fusions: Series(forward,
    backward), each an Overlap of its matmuls' compute and its ring, or a Series of such and
    compute forms): per Overlap, its compute on the compute lane (each device's busy seconds)
    and its exposed communication on the communication lane, max_e T_e - max_e busy_e; so the
    lanes sum to what the plan's prediction counts (cost_models.terms.busy and exposed)."""
    if not isinstance(cost, Series) or len(cost.parts) != 2:
        raise ValueError(f"instruction {index} ({instruction_name(plan, index)}): a fused instruction's cost is "
                         f"Series(forward, backward), not {type(cost).__name__}")
    name, n = instruction_name(plan, index), pb.width
    halves: list[list[InstructionTimes]] = []
    for half, part in zip(("forward", "backward"), cost.parts):
        pieces = []
        for piece in (part.parts if isinstance(part, Series) else (part,)):
            work = busy(piece, Category.COMPUTE, n)
            pieces.append(InstructionTimes(index, f"{name} ({half}: matmuls)", COMPUTE, pb.devices.expand(work),
                                           max(work), args | {"pass": half}))
            hidden = exposed(piece, Category.COMMUNICATION)
            if hidden > 0.0:
                pieces.append(InstructionTimes(index, f"{name} ({half}: exposed transfer)", COMMUNICATION,
                                               (hidden,) * plan.cluster.num_devices, hidden, args | {"pass": half}))
        halves.append(pieces)
    return halves[0], halves[1]


def _per_class_seconds(cost: Cost, plan: Plan, index: int) -> list[float]:
    """Seconds of each device class of an instruction that is one bulk-synchronous form (every
    instruction of today's plans); an instruction whose work overlaps is refused, naming it."""
    if not isinstance(cost, Form):
        raise ValueError(f"instruction {index} ({instruction_name(plan, index)}): its cost is a "
                         f"{type(cost).__name__} of forms; the trace lays out one form per instruction")
    values = cost.cost.per_device(cost.shares.values)
    return values if cost.devices is None else [values[i] if i in cost.devices else 0.0 for i in range(len(values))]


def device_totals(step: PredictedStep, num_devices: int) -> tuple[list[float], float]:
    """(compute seconds of each device, exposed communication seconds) of a step."""
    compute = [sum(p.share * p.times.per_device[i] for p in step.placed if p.times.lane == COMPUTE)
               for i in range(num_devices)]
    comm = sum(p.share * p.times.step_s for p in step.placed if p.times.lane == COMMUNICATION)
    return compute, comm + step.sync_wait[1]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(abs(a), abs(b), 1e-12)


def _check_totals(plan: Plan, step: PredictedStep) -> None:
    p = plan.predicted
    compute, comm = device_totals(step, plan.cluster.num_devices)
    bad = [f"step time {step.step_s:.6g} s vs {p.step_time_s:.6g} s"] if not _close(step.step_s, p.step_time_s) else []
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


def _slices(plan: Plan, placed: Placed) -> list[dict[str, Any]]:
    t, start_s = placed.times, placed.start_s
    step_s = placed.share * t.step_s
    devices = plan.cluster.devices
    slowest = max(range(len(devices)), key=lambda i: t.per_device[i])
    out = []
    for rank, device_s in enumerate(t.per_device):
        if t.lane == COMMUNICATION:
            out.append(complete(t.name, rank, COMMUNICATION, start_s, step_s, t.args))
            continue
        busy = placed.share * device_s
        out.append(complete(t.name, rank, COMPUTE, start_s, busy, {**t.args, "device_s": busy}))
        if step_s - busy > TOLERANCE * step_s:
            out.append(complete(f"wait for {devices[slowest].name}", rank, WAIT, start_s + busy, step_s - busy,
                                {"instruction": t.index, "waits_for": devices[slowest].name}))
    return out


def _sync_slices(plan: Plan, step: PredictedStep) -> list[dict[str, Any]]:
    """The buckets on the gradient sync lane, and the wait for them on the communication lane."""
    out = []
    start, wait = step.sync_wait
    for rank in range(plan.cluster.num_devices):
        out += [complete(b.name, rank, GRADIENT_SYNC, b.start_s, b.seconds, b.args) for b in step.buckets]
        if wait > 0.0:
            out.append(complete(SYNC_WAIT, rank, COMMUNICATION, start, wait, {"predicted_s": wait}))
    return out


def trace_document(plan: Plan, kind: str, events: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"hetsynth": kind, "model": plan.model.ref, "cluster": plan.cluster.name,
                          "plan_digest": plan_digest(plan), **extra}}


def predicted_trace(plan: Plan) -> dict[str, Any]:
    """The predicted step of `plan` as a Chrome trace (module docstring)."""
    step = predicted_step(plan)
    events = process_events(plan, (COMPUTE, COMMUNICATION, GRADIENT_SYNC, WAIT))
    for placed in step.placed:
        events += _slices(plan, placed)
    events += _sync_slices(plan, step)
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
