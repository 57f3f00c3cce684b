"""The pipeline part of `hetsynth report` for a plan of shape pipeline: the stages (sub-mesh,
device kinds, the graph calls and modules each computes, ratios, predicted forward and
backward per micro-batch, memory of the fullest device with the schedule's micro-batches in
flight: planner.stage_dp.stage_memory), the boundaries and their resharding, the schedule
with every schedule's predicted step, and the recorded predicted timeline
(instruction_set.pipeline.PipelinePrediction.timeline) drawn as one row per stage and one per
stage's sends; and that timeline as a Chrome trace (`hetsynth trace` on a pipeline plan): a
process per stage, its F/B/gradient sync on the compute lane, its sends on the communication
lane."""

from __future__ import annotations

import statistics
from html import escape
from typing import Any

from hetsynth.html_parts import LABEL, ROW, WIDTH, table
from hetsynth.html_parts import ms as _ms
from hetsynth.trace import COMMUNICATION, COMPUTE, LANES, complete, trace_document
from hetsynth.instruction_set.pipeline import Pipeline, PipelineStage, PredictedEvent
from hetsynth.instruction_set.plan import Plan

COLOURS = {"F": "#3b7dd8", "B": "#1f4e99", "SYNC": "#2a9d6f", "XFER_F": "#e8862a", "XFER_B": "#b8621a"}
WORDS = {"F": "forward", "B": "backward", "SYNC": "gradient sync", "XFER_F": "send activation",
         "XFER_B": "send gradient"}


def _modules(plan: Plan, stage: PipelineStage) -> str:
    """The first and last module the stage's calls come from."""
    paths = [n.module_path for n in plan.graph.calls[stage.calls[0]:stage.calls[1]] if n.module_path]
    return "–" if not paths else paths[0] if paths[0] == paths[-1] else f"{paths[0]} .. {paths[-1]}"


def _mean(events: list[PredictedEvent], stage: int, kind: str) -> str:
    spans = [e.end_s - e.start_s for e in events if e.stage == stage and e.kind == kind]
    return _ms(statistics.mean(spans)) if spans else "–"


def _stage_rows(plan: Plan, pipeline: Pipeline) -> list[list[str]]:
    from hetsynth.planner.stage_dp import stage_memory

    events, devices, rows = list(pipeline.predicted.timeline), plan.cluster.devices, []
    for s, (peak, cap, n) in zip(pipeline.stages, stage_memory(plan)):
        splan = s.plans[max(s.plans)]
        kinds = ", ".join(sorted({devices[r].kind for r in s.ranks}))
        rows.append([str(s.index), f"{s.ranks[0]}-{s.ranks[-1]} ({s.num_devices})", kinds,
                     f"{s.calls[0]}-{s.calls[1] - 1}", _modules(plan, s),
                     " / ".join(f"{r:.3f}" for r in splan.sharding_ratios), _mean(events, s.index, "F"),
                     _mean(events, s.index, "B"), f"{peak:.4g} of {cap:g} GiB ({n} micro-batches in flight)"])
    return rows


def _boundary_rows(pipeline: Pipeline) -> list[list[str]]:
    rows = []
    for i, b in enumerate(pipeline.boundaries):
        plan = b.reshard[max(b.reshard)]
        rows.append([str(i), b.tensor, f"{b.src_stage} -> {b.dst_stage}", f"{b.src_layout} -> {b.dst_layout}",
                     plan.method.value, _ms(plan.predicted_s)])
    return rows


def _rect(x0: float, y: int, width: float, colour: str, title: str, label: str) -> str:
    text = (f'<text x="{x0 + width / 2:.1f}" y="{y + 13}" text-anchor="middle" fill="#fff">{escape(label)}</text>'
            if width >= 12 and label else "")
    return (f'<rect x="{x0:.2f}" y="{y + 2}" width="{max(width, 0.3):.2f}" height="{ROW - 4}" fill="{colour}" '
            f'stroke="#fff" stroke-width="0.3"><title>{escape(title)}</title></rect>{text}')


def _event_name(e: PredictedEvent) -> str:
    return WORDS[e.kind] + ("" if e.micro_batch < 0 else f" mb {e.micro_batch}") + (
        "" if e.boundary is None else f" (boundary {e.boundary})")


def timeline_svg(pipeline: Pipeline) -> str:
    """Per stage a row of its F(m), B(m) and gradient sync, and a row of its sends."""
    events, n = pipeline.predicted.timeline, len(pipeline.stages)
    span = max([e.end_s for e in events] + [pipeline.predicted.step_time_s, 1e-12])
    scale = (WIDTH - LABEL - 10) / span
    parts = []
    for s in range(n):
        parts.append(f'<text x="0" y="{2 * s * ROW + 13}">stage {s}</text>'
                     f'<text x="0" y="{(2 * s + 1) * ROW + 13}">stage {s} sends</text>')
    for e in events:
        y = (2 * e.stage + (1 if e.kind.startswith("XFER") else 0)) * ROW
        parts.append(_rect(LABEL + e.start_s * scale, y, (e.end_s - e.start_s) * scale, COLOURS[e.kind],
                           f"stage {e.stage} {_event_name(e)}: {_ms(e.end_s - e.start_s)}",
                           "" if e.micro_batch < 0 else str(e.micro_batch)))
    axis = "".join(f'<text x="{LABEL + f * (WIDTH - LABEL - 10):.0f}" y="{2 * n * ROW + 14}">{span * f * 1e3:.1f} ms</text>'
                   for f in (0, 0.25, 0.5, 0.75))
    return f'<svg width="{WIDTH}" height="{2 * n * ROW + 20}" role="img" class="pipeline">{"".join(parts)}{axis}</svg>'


def pipeline_section(plan: Plan) -> str:
    pipeline = plan.pipeline
    assert pipeline is not None, "pipeline_section needs a pipeline plan"
    p = pipeline.predicted
    others = ", ".join(f"{k} {_ms(v)}" for k, v in p.schedules.items())
    legend = "".join(f'<span style="color:{c}">■</span> {k} ' for k, c in COLOURS.items())
    drawn = (timeline_svg(pipeline) if p.timeline else
             "<p class=note>this plan file records no timeline (written before plans recorded one)</p>")
    return (f"<h2>Pipeline: {len(pipeline.stages)} stages, {escape(pipeline.schedule.value)}, "
            f"{len(pipeline.micro_batches)} micro-batches</h2>"
            f"<p>micro-batch sizes {list(pipeline.micro_batches)}; predicted {_ms(p.step_time_s)} per step "
            f"(every schedule: {escape(others)}); the busiest stage idles {_ms(p.bubble_s)}"
            + (f"; one micro-batch: {escape(pipeline.coupled)}" if pipeline.coupled else "") + "</p>"
            + table(["stage", "ranks", "device kinds", "calls", "modules", "ratios", "forward / micro-batch",
                     "backward / micro-batch", "memory (fullest device)"], _stage_rows(plan, pipeline))
            + "<h3>Boundaries (cross-mesh resharding)</h3>"
            + table(["boundary", "tensor", "stages", "layouts", "method", "transfer (largest micro-batch)"],
                    _boundary_rows(pipeline))
            + f"<h3>Predicted timeline ({escape(pipeline.schedule.value)})</h3><p class=note>{legend} — "
              f"numbers are micro-batches; hover a slice for its time</p>" + drawn)


def pipeline_trace(plan: Plan) -> dict[str, Any]:
    """The recorded predicted timeline as a Chrome trace (module docstring)."""
    pipeline = plan.pipeline
    assert pipeline is not None, "pipeline_trace needs a pipeline plan"
    events: list[dict[str, Any]] = []
    for s in pipeline.stages:
        kinds = ", ".join(sorted({plan.cluster.devices[r].kind for r in s.ranks}))
        events.append({"name": "process_name", "ph": "M", "pid": s.index, "tid": 0,
                       "args": {"name": f"stage {s.index}: ranks {s.ranks[0]}-{s.ranks[-1]} ({kinds})"}})
        events += [{"name": "thread_name", "ph": "M", "pid": s.index, "tid": t, "args": {"name": LANES[t]}}
                   for t in (COMPUTE, COMMUNICATION)]
    for e in pipeline.predicted.timeline:
        lane = COMMUNICATION if e.kind.startswith("XFER") else COMPUTE
        events.append(complete(_event_name(e), e.stage, lane, e.start_s, e.end_s - e.start_s,
                               {"micro_batch": e.micro_batch, "kind": e.kind}))
    return trace_document(plan, "predicted pipeline", events, step_time_s=pipeline.predicted.step_time_s,
                          schedule=pipeline.schedule.value)
