"""One self-contained HTML page about a plan (`hetsynth report plan.json [--measured m.json]`).

The page needs no network and no server: styles are inline, every drawing is inline SVG, and
the file names no external URL (no scripts, images, fonts or links). Sections:

1. the cluster: devices by kind, nodes, links (hetsynth.report.cluster_summary);
2. the sharding ratio and the batch rows of every device, and the shard lengths of the
   largest split tensors;
3. memory per device against its capacity;
4. the predicted step time against every baseline the plan records;
5. the instruction mix (hetsynth.report.instruction_mix);
6. a timeline of the predicted step (hetsynth.trace: one row per device, compute, waits and
   communication) and, with a measured trace, of the measured step on the same time scale;
7. with a measured trace: predicted against measured step, and the ten instructions whose
   prediction and measurement differ most (hetsynth.measured.comparison).

A pipeline plan's page has the cluster and, instead of 2-7, hetsynth.report_pipeline's
stages, boundaries and predicted timeline.

We write the HTML ourselves: it is a few tables and rectangles, and a templating or plotting
library would add a dependency (and most of them load scripts from the network).
"""

from __future__ import annotations

from html import escape
from typing import Any

from hetsynth.report import cluster_summary, instruction_mix, si
from hetsynth.trace import COMMUNICATION, COMPUTE, GRADIENT_SYNC, PHASES, WAIT, predicted_trace
from hetsynth.html_parts import LABEL, ROW, STYLE, WIDTH, table
from hetsynth.html_parts import ms as _ms
from hetsynth.report_pipeline import pipeline_section
from hetsynth.instruction_set.plan import Plan, PlanShape

COLOURS = {COMPUTE: "#3b7dd8", COMMUNICATION: "#e8862a", WAIT: "#cfcfcf", GRADIENT_SYNC: "#2a9d6f"}
MAX_ROWS = 16  # devices drawn in a timeline


def cluster_section(plan: Plan) -> str:
    s = cluster_summary(plan.cluster)
    kinds = [[k, v["count"], si(v["throughput_flops"], "FLOP/s"), f"{v['memory_gib']:g} GiB",
              "measured" if v["measured"] else "nominal"] for k, v in s["kinds"].items()]
    nodes = [[n["name"], n["devices"], n["kind"], f"{n['intra_bandwidth_gbps']:g}", f"{n['nic_bandwidth_gbps']:g}"]
             for n in s["nodes"]]
    links = s["links"]
    return (f"<h2>Cluster {escape(s['name'])}</h2><p>{s['num_devices']} devices on {s['num_nodes']} nodes, "
            f"{si(s['total_throughput_flops'], 'FLOP/s')}, {s['total_memory_gib']:g} GiB in all</p>"
            f"<p>precision {escape(plan.precision_policy().describe())}</p>"
            + table(["device kind", "count", "throughput", "memory", "figures"], kinds)
            + table(["node", "devices", "kind", "intra-node Gbit/s", "NIC Gbit/s"], nodes)
            + f"<p>links: intra-node {links['intra_node_bandwidth_gbps']:g} Gbit/s, {links['intra_node_latency_us']:g} us; "
              f"inter-node {links['inter_node_bandwidth_gbps']:g} Gbit/s, {links['inter_node_latency_us']:g} us</p>")


def _batch_rows(plan: Plan) -> list[int]:
    """Rows of the batch each device holds (its first input's split; all rows if replicated)."""
    n = plan.cluster.num_devices
    for ins in plan.instructions:
        if ins.kind == "input":
            lengths = plan.lengths(ins.tensor, ins.layout).get(0) if ins.layout.is_shard else None
            return list(lengths) if lengths else [plan.model.batch_size] * n
    return [plan.model.batch_size] * n


def collapse(rows: list[list[Any]], free: tuple[int, ...] = ()) -> list[list[Any]]:
    """Consecutive rows equal but for their first column (the device) and the `free` columns
    as one row: `16: p100-0/0 .. 63: p100-5/7 (48)`, free columns as `first .. last`."""
    groups: list[list[list[Any]]] = []
    same = lambda a, b: all(x == y for i, (x, y) in enumerate(zip(a, b)) if i and i not in free)
    for row in rows:
        if groups and same(groups[-1][0], row):
            groups[-1].append(row)
        else:
            groups.append([row])
    out = []
    for g in groups:
        if len(g) == 1:
            out.append(g[0])
            continue
        span = lambda i: g[0][i] if g[0][i] == g[-1][i] else f"{g[0][i]} .. {g[-1][i]}"
        out.append([f"{g[0][0]} .. {g[-1][0]} ({len(g)})"] + [span(i) for i in range(1, len(g[0]))])
    return out


def lengths_text(lengths: tuple[int, ...] | list[int]) -> str:
    """'5 / 3', or for many ranks runs: '1 x16 / 0 x48'."""
    if len(lengths) <= 8:
        return " / ".join(str(x) for x in lengths)
    runs: list[list[int]] = []
    for x in lengths:
        if runs and runs[-1][0] == x:
            runs[-1][1] += 1
        else:
            runs.append([x, 1])
    return " / ".join(f"{x} x{n}" if n > 1 else str(x) for x, n in runs)


def ratio_section(plan: Plan) -> str:
    node_of = {d: node.name for node in plan.cluster.nodes for d in node.devices}
    rows = collapse([[f"{r}: {d.name}", d.kind, node_of.get(d.name, ""), f"{ratio:.4f}", rows_]
                     for r, (d, ratio, rows_) in enumerate(zip(plan.cluster.devices, plan.sharding_ratios,
                                                               _batch_rows(plan)))], free=(2,))
    splits = []
    for tensor, layouts in plan.shards.items():
        for layout, dims in layouts.items():
            for dim, lengths in dims.items():
                splits.append((plan.graph.node(tensor).out.numel, f"{tensor}:{layout} dim {dim}", lengths))
    splits.sort(key=lambda s: -s[0])
    shard_rows = [[name, f"{numel:,}", lengths_text(lengths)] for numel, name, lengths in splits[:12]]
    return ("<h2>Sharding ratios and shard lengths</h2>"
            + table(["device", "kind", "node", "ratio", "batch rows"], rows)
            + f"<p class=note>the {len(shard_rows)} largest of {len(splits)} splits: local length on each rank</p>"
            + table(["tensor:layout", "elements", "lengths by rank"], shard_rows))


def bars(items: list[tuple[str, float, float | None, str]], unit: str) -> str:
    """Horizontal bars (label, value, limit marker or None, colour) as inline SVG."""
    top = max([v for _, v, _, _ in items] + [c for _, _, c, _ in items if c is not None] + [1e-30])
    scale = (WIDTH - LABEL - 120) / top
    parts = []
    for i, (label, value, limit, colour) in enumerate(items):
        y = i * (ROW + 4)
        parts.append(f'<text x="0" y="{y + 13}">{escape(label)}</text>'
                     f'<rect x="{LABEL}" y="{y}" width="{value * scale:.1f}" height="{ROW}" fill="{colour}"/>'
                     f'<text x="{LABEL + value * scale + 4:.1f}" y="{y + 13}">{value:.4g} {unit}</text>')
        if limit is not None:
            parts.append(f'<line x1="{LABEL + limit * scale:.1f}" x2="{LABEL + limit * scale:.1f}" y1="{y - 2}" '
                         f'y2="{y + ROW + 2}" stroke="#b00" stroke-width="2"/>')
    return f'<svg width="{WIDTH}" height="{len(items) * (ROW + 4)}" role="img">{"".join(parts)}</svg>'


def memory_section(plan: Plan) -> str:
    devices = plan.predicted.devices
    rows = collapse([[f"{r}: {d.name}", d.kind, f"{d.memory_gib:.4f}", f"{d.memory_capacity_gib:g}",
                      f"{100 * d.memory_gib / d.memory_capacity_gib:.1f}%"] for r, d in enumerate(devices)])
    shown = sorted({int(str(row[0]).split(":")[0]) for row in rows})[:MAX_ROWS]
    items = [(f"{r}: {devices[r].name}", devices[r].memory_gib, devices[r].memory_capacity_gib,
              "#b00" if devices[r].memory_gib > devices[r].memory_capacity_gib else "#5a9e5a") for r in shown]
    return ("<h2>Memory per device</h2><p>" + ("fits" if plan.predicted.fits else '<span class=bad>does not fit</span>')
            + " (red line: the device's capacity)</p>" + table(["device", "kind", "GiB", "capacity GiB", "used"], rows)
            + bars(items, "GiB"))


def baseline_section(plan: Plan) -> str:
    p = plan.predicted
    rows = [["hetsynth", _ms(p.step_time_s), "1.00x", "yes" if p.fits else "no", ""]]
    rows += [[name, _ms(b.step_time_s), f"{b.step_time_s / p.step_time_s:.2f}x", "yes" if b.fits else "no", b.note]
             for name, b in plan.baselines.items()]
    items = [("hetsynth", p.step_time_s * 1e3, None, COLOURS[COMPUTE])]
    items += [(name, b.step_time_s * 1e3, None, "#888") for name, b in plan.baselines.items()]
    return ("<h2>Predicted step time against the baselines</h2>"
            + table(["plan", "step time", "hetsynth speed-up", "fits", "note"], rows) + bars(items, "ms"))


def mix_section(plan: Plan) -> str:
    return "<h2>Instruction mix</h2>" + table(["instruction", "count"], [[k, v] for k, v in instruction_mix(plan).items()])


def timeline_svg(trace: dict[str, Any], title: str, span_us: float, lanes: tuple[int, ...], pids: list[int],
                 step: int | None = None) -> str:
    """One row per process of `pids` and lane of a trace (of the slices of `step` only, when
    given), rectangles on a common scale (0..span_us)."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    rows = [(pid, tid) for pid in pids for tid in lanes]
    index = {key: i for i, key in enumerate(rows)}
    scale = (WIDTH - LABEL - 10) / max(span_us, 1e-9)
    parts = [f'<text x="0" y="{i * ROW + 13}">{escape(names[pid].split(" (")[0][:18])} '
             f'{["", "compute", "comm", "wait", "phases", "grad sync"][tid]}</text>' for i, (pid, tid) in enumerate(rows)]
    for e in trace["traceEvents"]:
        if e["ph"] != "X" or (e["pid"], e["tid"]) not in index or e["dur"] <= 0 or e["args"].get("step", step) != step:
            continue
        y = index[(e["pid"], e["tid"])] * ROW
        colour = COLOURS.get(e["tid"], "#7a5ea8")
        parts.append(f'<rect x="{LABEL + e["ts"] * scale:.2f}" y="{y + 2}" width="{max(e["dur"] * scale, 0.3):.2f}" '
                     f'height="{ROW - 4}" fill="{colour}" stroke="#fff" stroke-width="0.2">'
                     f'<title>{escape(e["name"])}: {e["dur"] / 1e3:.3f} ms</title></rect>')
    axis = "".join(f'<text x="{LABEL + f * (WIDTH - LABEL - 10):.0f}" y="{len(rows) * ROW + 14}">'
                   f'{span_us * f / 1e3:.1f} ms</text>' for f in (0, 0.25, 0.5, 0.75))
    return (f"<h3>{escape(title)}</h3><svg width=\"{WIDTH}\" height=\"{len(rows) * ROW + 20}\" role=\"img\" "
            f"class=\"timeline\">{''.join(parts)}{axis}</svg>")


def _span_us(trace: dict[str, Any], step: int | None = None) -> float:
    return max((e["ts"] + e["dur"] for e in trace["traceEvents"]
                if e["ph"] == "X" and e["args"].get("step", step) == step), default=0.0)


def _first_step(measured: dict[str, Any]) -> int | None:
    """The first traced step (hetsynth.measured lays it at time 0)."""
    return (measured["otherData"].get("traced_steps") or [None])[0]


def shown_devices(plan: Plan) -> list[int]:
    """Every device, or on clusters of more than MAX_ROWS devices the first device of each
    (kind, ratio), at most MAX_ROWS of them."""
    n = plan.cluster.num_devices
    if n <= MAX_ROWS:
        return list(range(n))
    first: dict[tuple[str, float], int] = {}
    for rank, (device, ratio) in enumerate(zip(plan.cluster.devices, plan.sharding_ratios)):
        first.setdefault((device.kind, round(ratio, 9)), rank)
    return sorted(first.values())[:MAX_ROWS]


def timeline_section(plan: Plan, measured: dict[str, Any] | None) -> str:
    predicted = predicted_trace(plan)
    step = _first_step(measured) if measured else None
    span = max(_span_us(predicted), _span_us(measured, step) if measured else 0.0)
    legend = (f'<p class=note><span style="color:{COLOURS[COMPUTE]}">■</span> compute '
              f'<span style="color:{COLOURS[COMMUNICATION]}">■</span> communication '
              f'<span style="color:{COLOURS[WAIT]}">■</span> waiting for the slowest device '
              f'<span style="color:{COLOURS[GRADIENT_SYNC]}">■</span> gradient buckets (overlapping the backward) '
              f'<span style="color:#7a5ea8">■</span> step phases (measured). Each instruction of the predicted '
              f'step covers its forward and its backward; hover a slice for its name.</p>')
    pids = shown_devices(plan)
    if len(pids) < plan.cluster.num_devices:
        legend += (f"<p class=note>{len(pids)} of {plan.cluster.num_devices} devices shown: the first of each device "
                   f"kind and ratio (the trace files hold every device)</p>")
    out = "<h2>Timeline of a step</h2>" + legend
    out += timeline_svg(predicted, f"predicted ({_ms(plan.predicted.step_time_s)})", span, (COMPUTE, COMMUNICATION, GRADIENT_SYNC, WAIT),
                        pids)
    if measured:
        out += timeline_svg(measured, f"measured (traced step {step}; the trace file holds every traced step)",
                            span, (COMPUTE, COMMUNICATION, PHASES), pids, step)
    return out


def difference_section(result: dict[str, Any]) -> str:
    step = result["step"]
    rows = [["step", _ms(step["predicted_s"]), _ms(step["measured_s"]),
             f"{step['measured_s'] / step['predicted_s']:.2f}" if step["measured_s"] else "–"]]
    rows += [[g["name"] + " (bulk)", _ms(g["predicted_s"]), _ms(g["measured_s"]),
              f"{g['measured_s'] / g['predicted_s']:.2f}" if g["predicted_s"] else "–"] for g in result["bulk"]]
    worst = sorted(result["instructions"], key=lambda r: -abs(r["measured_s"] - r["predicted_s"]))[:10]
    top = [[f"#{r['instruction']} {r['name']}", r["lane"], _ms(r["predicted_s"]), _ms(r["measured_s"]),
            f"{(r['measured_s'] - r['predicted_s']) * 1e3:+.3f} ms"] for r in worst]
    return ("<h2>Predicted against measured</h2>"
            + table(["what", "predicted", "measured", "measured / predicted"], rows)
            + f"<p class=note>measured: the slowest rank, median over steps {result['traced_steps']}; data loading "
              f"({_ms(step['data_s'])}) is not predicted</p>"
            + "<h3>The ten instructions where prediction and measurement differ most</h3>"
            + table(["instruction", "lane", "predicted", "measured", "difference"], top))


def report_html(plan: Plan, measured: dict[str, Any] | None = None, comparison: dict[str, Any] | None = None) -> str:
    """The page (module docstring); `measured` is a measured trace of this plan and
    `comparison` its hetsynth.measured.comparison."""
    if plan.shape is PlanShape.PIPELINE:
        return _page(plan, [_pipeline_head(plan), cluster_section(plan), pipeline_section(plan)])
    p = plan.predicted
    head = (f"<h1>hetsynth plan: {escape(plan.model.ref)} on {escape(plan.cluster.name)}</h1>"
            f"<p>{plan.model.num_params:,} parameters, batch {plan.model.batch_size}; predicted "
            f"{_ms(p.step_time_s)} per step (compute {_ms(p.compute_s)}, communication {_ms(p.communication_s)})"
            + (f"; measured {_ms(comparison['step']['measured_s'])}" if comparison else "") + "</p>")
    body = [head, cluster_section(plan), ratio_section(plan), memory_section(plan), baseline_section(plan),
            mix_section(plan), timeline_section(plan, measured)]
    if comparison:
        body.append(difference_section(comparison))
    return _page(plan, body)


def _pipeline_head(plan: Plan) -> str:
    """The page's title for a pipeline plan, with the SPMD plan it was preferred to."""
    assert plan.pipeline is not None
    spmd = plan.predicted
    return (f"<h1>hetsynth plan: {escape(plan.model.ref)} on {escape(plan.cluster.name)}</h1>"
            f"<p>{plan.model.num_params:,} parameters, batch {plan.model.batch_size}; a pipeline of "
            f"{len(plan.pipeline.stages)} stages, predicted {_ms(plan.pipeline.predicted.step_time_s)} per step; the "
            f"best SPMD plan on the whole cluster: {_ms(spmd.step_time_s)}"
            + ("" if spmd.fits else " (does not fit in memory)") + "</p>")


def _page(plan: Plan, body: list[str]) -> str:
    return (f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>hetsynth report: "
            f"{escape(plan.model.ref)}</title><style>{STYLE}</style></head><body>{''.join(body)}</body></html>")
