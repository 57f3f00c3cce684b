"""A run's measured steps as a Chrome trace, and per-instruction predicted vs measured seconds.

`hetsynth run plan.json --trace measured.json` has every rank record the wall time of every
instruction of the traced steps (runtime.timing: raw perf_counter times, relative to the
start of the step, which every rank begins after a barrier). Here they become

- one trace in hetsynth.trace's format and naming: a process per rank, the compute and the
  communication lanes (an instruction's forward slice, and one slice per stretch of its
  backward autograd nodes, `args.pass` telling which), and a lane of the step's phases
  (data, forward, backward, gradient_sync, update, loss). Traced step j starts where the
  slowest rank finished step j-1;
- a comparison: per instruction, the predicted seconds (the plan's, forward and backward)
  against the measured forward + backward seconds on each rank, median over the traced
  steps; the slowest rank's is the instruction's measured time (instructions are
  bulk-synchronous). What the runtime does in bulk is compared in bulk: the gradient
  buckets' all-reduces overlap the backward, so the part of them the plan predicts left after
  it (hetsynth.trace's wait for gradient sync) with the gradient_sync phase (the wait after the
  backward); the optimizer updates and the step's scalar all-reduces with the update and loss
  phases.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from hetsynth.instruction_set.files import write_atomic
from hetsynth.instruction_set.plan import Plan
from hetsynth.trace import (COMMUNICATION, COMPUTE, PHASES, complete, instruction_name, lane_of,
                            plan_digest, predicted_step, process_events, trace_document)

MERGE_GAP_S = 2e-6  # backward node intervals of one instruction closer than this are one slice
PHASE_LANES = {"data": COMPUTE, "gradient_sync": COMMUNICATION, "update": COMPUTE, "loss": COMMUNICATION}
PHASE_NAMES = {"data": "data (this rank's rows of the batch)", "gradient_sync": "gradient sync (bucketed all-reduces)",
               "update": "optimizer update (global-norm all-reduce, clipping, step)", "loss": "loss all-reduce"}


def read_raw(directory: str | Path, world_size: int) -> list[dict[str, Any]]:
    """Every rank's raw record (runtime.timing.StepTracer.record), by rank."""
    records = []
    for rank in range(world_size):
        path = Path(directory, f"rank{rank}.json")
        if not path.is_file():
            raise FileNotFoundError(f"rank {rank} wrote no trace record ({path})")
        records.append(json.loads(path.read_text()))
    return records


def _forward_spans(step: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(instruction, start, end): each instruction runs from the end of the previous stamp
    to the start of its own (runtime.timing)."""
    forward_start = next(s for name, s, _ in step["phases"] if name == "forward")
    out, at = [], forward_start
    for index, end, resume in step["forward"]:
        out.append((index, at, end))
        at = resume
    return out


def _backward_spans(step: dict[str, Any]) -> list[tuple[int, float, float]]:
    """Autograd node intervals, adjacent ones of the same instruction merged."""
    out: list[list[Any]] = []
    for index, start, end in sorted(step["backward"], key=lambda e: e[1]):
        if out and out[-1][0] == index and start - out[-1][2] < MERGE_GAP_S:
            out[-1][2] = end
        else:
            out.append([index, start, end])
    return [(i, s, e) for i, s, e in out]


def _rank_events(plan: Plan, rank: int, step: dict[str, Any], offset: float) -> list[dict[str, Any]]:
    out = []
    for kind, spans in (("forward", _forward_spans(step)), ("backward", _backward_spans(step))):
        for index, start, end in spans:
            ins = plan.instructions[index]
            out.append(complete(instruction_name(plan, index), rank, lane_of(ins), offset + start, end - start,
                                {"instruction": index, "pass": kind, "step": step["step"],
                                 "predicted_s": ins.predicted_s}))
    for name, start, end in step["phases"]:
        out.append(complete(name, rank, PHASES, offset + start, end - start, {"step": step["step"]}))
        if name in PHASE_LANES:
            out.append(complete(PHASE_NAMES[name], rank, PHASE_LANES[name], offset + start, end - start,
                                {"step": step["step"]}))
    return out


def measured_trace(plan: Plan, records: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' raw records as one trace (module docstring)."""
    events = process_events(plan, (COMPUTE, COMMUNICATION, PHASES))
    offset = 0.0
    for j in range(len(records[0]["steps"])):
        for rank, record in enumerate(records):
            events += _rank_events(plan, rank, record["steps"][j], offset)
        offset += max(r["steps"][j]["phases"][-1][2] for r in records)
    steps = [[r["steps"][j]["seconds"] for r in records] for j in range(len(records[0]["steps"]))]
    return trace_document(plan, "measured", events, step_seconds_by_rank=steps,
                          traced_steps=[s["step"] for s in records[0]["steps"]])


def instruction_seconds(trace: dict[str, Any], num_ranks: int) -> tuple[dict[int, list[float]], dict[str, list[float]]]:
    """From a measured trace: instruction -> each rank's forward + backward seconds and phase
    -> each rank's seconds, medians over the traced steps."""
    per: dict[tuple[Any, int, int], float] = {}
    for e in trace["traceEvents"]:
        if e["ph"] != "X":
            continue
        args = e["args"]
        key = ("phase", e["name"]) if e["tid"] == PHASES else ("instruction", args.get("instruction"))
        if key[1] is None:
            continue
        full = (key, e["pid"], args["step"])
        per[full] = per.get(full, 0.0) + e["dur"] / 1e6
    steps = sorted({s for (_, _, s) in per})
    out: dict[Any, list[float]] = {}
    for key in {k for (k, _, _) in per}:
        out[key] = [statistics.median(per.get((key, r, s), 0.0) for s in steps) for r in range(num_ranks)]
    instructions = {k[1]: v for k, v in out.items() if k[0] == "instruction"}
    return instructions, {k[1]: v for k, v in out.items() if k[0] == "phase"}


def comparison(plan: Plan, trace: dict[str, Any]) -> dict[str, Any]:
    """Per-instruction predicted vs measured seconds (module docstring)."""
    n = plan.cluster.num_devices
    measured, phases = instruction_seconds(trace, n)
    step = predicted_step(plan)
    rows: dict[int, dict[str, Any]] = {}
    bulk = {"gradient sync": [step.sync_wait[1], ["gradient_sync"]], "update and step all-reduces": [0.0, ["update", "loss"]]}
    for t in step.instructions:
        ins = plan.instructions[t.index] if t.index is not None else None
        if ins is None or ins.kind == "param":
            bulk["update and step all-reduces"][0] += t.step_s
        elif t.index in rows:  # a fused instruction's pieces (hetsynth.trace._fused_times): one row, added up
            row = rows[t.index]
            row["predicted_s"] += t.step_s
            row["predicted_s_by_rank"] = [a + b for a, b in zip(row["predicted_s_by_rank"], t.per_device)]
        else:
            by_rank = measured.get(t.index, [0.0] * n)
            rows[t.index] = {"instruction": t.index, "name": instruction_name(plan, t.index), "kind": ins.kind,
                             "lane": "compute" if lane_of(ins) == COMPUTE else "communication",
                             "predicted_s": t.step_s, "predicted_s_by_rank": list(t.per_device),
                             "measured_s": max(by_rank), "measured_s_by_rank": by_rank}
    groups = [{"name": name, "predicted_s": pred, "phases": names,
               "measured_s": max(sum(phases.get(p, [0.0] * n)[r] for p in names) for r in range(n))}
              for name, (pred, names) in bulk.items()]
    step_by_rank = trace["otherData"].get("step_seconds_by_rank", [])
    return {"plan_digest": plan_digest(plan), "model": plan.model.ref, "cluster": plan.cluster.name,
            "traced_steps": trace["otherData"].get("traced_steps", []),
            "step": {"predicted_s": plan.predicted.step_time_s,
                     "measured_s": statistics.median(max(s) for s in step_by_rank) if step_by_rank else None,
                     "data_s": max(phases.get("data", [0.0])), "note": "data loading is not predicted"},
            "bulk": groups, "instructions": [rows[i] for i in sorted(rows)]}


def companion_path(trace_path: str | Path) -> Path:
    """Where `--trace X.json` writes its comparison: X.instructions.json."""
    path = Path(trace_path)
    stem = path.name[:-5] if path.name.endswith(".json") else path.name
    return path.with_name(f"{stem}.instructions.json")


def write_measured(plan: Plan, raw_dir: str | Path, trace_path: str | Path) -> dict[str, Any]:
    """Merge the ranks' raw records; write the trace and its comparison; return the latter."""
    trace = measured_trace(plan, read_raw(raw_dir, plan.cluster.num_devices))
    write_atomic(trace_path, json.dumps(trace))
    result = comparison(plan, trace)
    write_atomic(companion_path(trace_path), json.dumps(result, indent=1))
    return result


def load_measured(path: str | Path, plan: Plan) -> dict[str, Any]:
    """A measured trace of this plan (ValueError naming the file and what is wrong)."""
    where = f"--measured {str(path)!r}"
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{where}: no such file (give the trace `hetsynth run --trace` wrote)")
    try:
        trace = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{where}: not JSON ({err})") from None
    other = trace.get("otherData", {}) if isinstance(trace, dict) else {}
    if not isinstance(other, dict) or other.get("hetsynth") != "measured" or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{where}: not a measured trace of `hetsynth run --trace` (a predicted trace, or another "
                         f"tool's?)")
    if other.get("plan_digest") != plan_digest(plan):
        raise ValueError(f"{where}: a trace of another plan (plan digest {other.get('plan_digest')!r}, this plan's "
                         f"is {plan_digest(plan)!r}; model {other.get('model')!r}); trace a run of this plan")
    return trace
