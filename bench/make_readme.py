"""Write bench/README.md from bench/results/*.json, and the headline block of the top README.

    .venv/bin/python bench/make_readme.py           # (re)write bench/README.md and README.md's block
    .venv/bin/python bench/make_readme.py --check   # exit 1, saying what differs, when either is stale

Every figure comes from a result file (bench/common.py write_json writes them, each with a
"meta" object: command, date, machine, commit); the prose that says what a benchmark measures
and how to read its table lives here. The headline block is the text between the lines
`<!-- headline-results:begin -->` and `<!-- headline-results:end -->` in README.md; only that
text is replaced (where the markers are missing, write mode skips it and --check reports it).
"""

from __future__ import annotations

import argparse
import difflib
import json
import statistics
import sys
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
OUTPUT = BENCH / "README.md"
TOP_README = ROOT / "README.md"
BEGIN, END = "<!-- headline-results:begin -->", "<!-- headline-results:end -->"
REGENERATE = ".venv/bin/python bench/make_readme.py"

Json = dict[str, Any]
TMP_PATH = re.compile(r"/tmp/[^\s'\"]*/")  # a run's temporary directory in a recorded message
SPEC_USES = {
    "local-emulated-measured.toml": "read by measured_speedup, ddp_overhead, overlap, sfb, trace_overhead, the "
                                    "pipeline bench's local part and `make demo`",
    "slow-link-emulated-measured.toml": "read by the pipeline bench (main scenario)",
    "slow-pair-emulated-measured.toml": "read by the pipeline bench (eager scenario)",
    "collectives-emulated-measured.toml": "the emulated environment's fits of the collectives bench",
    "collectives-local-measured.toml": "the plain local processes' fits of the collectives bench",
}


# ---------------------------------------------------------------------------------------------
# formatting


def table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value != value:  # nan
        return "nan"
    return f"{value:.{digits}f}"


def ms(seconds: Any, digits: int = 1) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.{digits}f}"


def x(ratio: Any, digits: int = 2) -> str:
    return "-" if ratio is None else f"{ratio:.{digits}f}x"


def pct(fraction: Any, digits: int = 1) -> str:
    return "-" if fraction is None else f"{fraction * 100:+.{digits}f}%"


def sci(value: Any) -> str:
    return "-" if value is None else f"{value:.1e}"


def spread(values: list[float], fmt: Callable[[Any], str]) -> str:
    """'median (min-max)' of values, or the one value."""
    if len(values) == 1:
        return fmt(values[0])
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


def runs_text(n: int) -> str:
    return "1 run" if n == 1 else f"{n} runs"


def machine_text(machine: Any) -> str:
    if not isinstance(machine, dict):
        return str(machine)
    parts = [str(machine.get("cpu", "unknown CPU"))]
    if machine.get("logical_cores") is not None:
        parts.append(f"{machine['logical_cores']} logical cores")
    if machine.get("memory_gib") is not None:
        parts.append(f"{machine['memory_gib']} GiB memory")
    parts.append(f"GPU: {machine.get('gpu', 'unknown')}")
    parts.append(f"torch {machine.get('torch', 'unknown')}")
    return ", ".join(parts)


def meta_block(data: Json, name: str) -> str:
    """What produced `name`: command, date, machine and commit, from its meta object."""
    meta = data.get("meta")
    if not isinstance(meta, dict):
        return f"*`bench/results/{name}` has no meta (written before results carried one).*"
    commit = meta.get("commit") or {}
    if isinstance(commit, str):
        commit = {"hash": commit}
    short = str(commit.get("hash", "unknown"))[:10]
    dirty = " with uncommitted changes" if commit.get("dirty") else ""
    date = str(meta.get("date", "unknown")).replace("+00:00", "Z")
    lines = [f"- Command: `{meta.get('command', 'not recorded')}`",
             f"- Date: {date}",
             f"- Machine: {machine_text(meta.get('machine', 'not recorded'))}",
             f"- Commit: `{short}`{dirty}",
             f"- Data: `bench/results/{name}`"]
    if meta.get("backfilled"):
        lines.append("- *meta backfilled from git history*: the command is the script's (with the arguments "
                     "the file records), the date and commit are those of the commit that last changed the "
                     "file; the machine was not recorded.")
    return "\n".join(lines)


def load(name: str) -> Json | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.is_file() else None


# ---------------------------------------------------------------------------------------------
# sections: each takes its result(s) and returns Markdown (without the heading)


def pipeline_section(d: Json) -> str:
    out = ["Pipeline plans against SPMD and data-parallel plans on emulated clusters whose two nodes share "
           "a slow link (50 Mbit/s). **main** runs on `configs/clusters/slow-link-emulated.toml` (2 workers "
           "at 0.5 CPU, 2 at 0.25) with a 4-layer GPT `small-cpu` of hidden 256: the planner's own "
           "`--stages auto` pipeline, the same stages under the other schedules, its SPMD plan and DP-CP. "
           "**eager** runs on `configs/clusters/slow-pair-emulated.toml` (one 0.9-CPU worker per node). "
           "Each cluster is profiled first and every plan is made with `--measure-ops`; the plans train "
           "interleaved and the table gives median seconds per step, the prediction and its error "
           "((predicted - measured) / measured), and how much faster each plan is than the SPMD plan and "
           "DP-CP (above 1x: faster). \"(chosen)\" marks the plan the planner keeps.", ""]
    rows = []
    notes = []
    for key, scenario in d["models"].items():
        name, _, ref = key.partition(": ")
        plans = scenario["plans"]
        chosen = "spmd" if scenario.get("chosen_shape") == "spmd" else f"pipeline_{scenario.get('chosen_schedule')}"
        spmd, dp_cp = plans["spmd"]["measured_s"], plans["dp_cp"]["measured_s"]
        for plan, r in plans.items():
            rows.append([name, plan + (" (chosen)" if plan == chosen else ""), num(r["measured_s"]),
                         num(r["predicted_s"]), pct(r["error"]), x(spmd / r["measured_s"]),
                         x(dp_cp / r["measured_s"])])
        transfer = "; ".join(f"{t['tensor']}: " + " and ".join(x(v, 2) for v in t["c_over_f_plus_b"])
                             for t in scenario.get("transfer_vs_compute", []))
        notes.append(f"- **{name}** (`{ref}` on {scenario['cluster']}): {scenario['stages']}"
                     + (f"; a boundary transfer takes {transfer} a stage's micro-batch compute (C / (F + B))"
                        if transfer else "") + ".")
    out += [table(["scenario", "plan", "measured s", "predicted s", "error", "SPMD / it", "DP-CP / it"], rows), ""]
    out += notes
    local = d.get("local_emulated")
    if local:
        out += ["", f"On the shipped `local-emulated.toml` (its measured spec) the planner keeps "
                    f"{local['shape'].upper() if local['shape'] == 'spmd' else local['shape']} for "
                    f"`{local['model']}` with `--stages auto`: SPMD predicted {num(local['spmd_predicted_s'])} s, "
                    f"the best pipeline {num(local['pipeline_predicted_s'])} s ({local['pipeline']})."]
    out += ["", "Why the eager scenario has its own cluster: a worker held to a small CPU quota computes at full "
                "speed for its quota and then idles for the rest of each period, so a wait for a transfer "
                "falls into idle time at no cost and the schedules' exposed transfers do not show; at 0.9 CPU a "
                "wait costs what it costs on a device. The executor records every action's start and end "
                "(`runtime.compare` writes them as `events_by_rank` for pipeline plans)."]
    return "\n".join(out)


def resharding_section(d: Json) -> str:
    methods = ["send_recv", "local_allgather", "broadcast", "broadcast_lb"]
    rows = []
    for c in d["cases"]:
        diag = c.get("diagnostics", {})
        m = c["methods"]
        rows.append([c["name"], *[f"{num(m[k]['measured_s'])} ({num(m[k]['predicted_s'])})" for k in methods],
                     num(c["lower_bound_s"]), num(diag.get("sr_over_lb"), 2), num(diag.get("lb_over_bound"), 2),
                     c["picked"], diag.get("fastest", "-"), "yes" if c["correct"] else "NO"])
    acc = d.get("acceptance", {})
    within = sum(1 for c in d["cases"] if c.get("diagnostics", {}).get("pick_within_10pct"))
    summary = [f"- broadcast_lb / send_recv where the model says 4x or more: "
               f"{', '.join(f'{k} {num(v, 2)}' for k, v in acc.get('sr_over_lb_where_model_4x', {}).items())} "
               f"(least {num(acc.get('min_sr_over_lb_where_model_4x'), 2)}).",
               f"- broadcast_lb slower than send_recv in: {', '.join(acc.get('lb_slower_than_sr', [])) or 'no case'}.",
               f"- broadcast_lb / NIC bound at most {num(acc.get('max_lb_over_bound'), 2)}.",
               f"- the method the cost model picks measured within 10% of the fastest in {within} of "
               f"{len(d['cases'])} cases; every destination correct: {'yes' if acc.get('all_correct') else 'NO'}."]
    return "\n".join([
        "Cross-mesh resharding (Zhuang et al., MLSys'23) on emulated clusters of 4 CPU ranks per host (a network "
        "namespace per host, its NIC shaped both ways, ranks of a host on loopback): 4 hosts at 500 Mbit/s, "
        "4 hosts at 500/250/500/500 Mbit/s (`two-speed-*`), and 5 hosts for the paper's case 6. float64 "
        "tensors of 32 MiB; medians of the repetitions after a warm-up, methods rotated; seconds from a "
        "barrier until the last rank is done, the cost model's prediction in brackets. \"NIC bound\" is the "
        "least time the busiest NIC needs; `sr / lb` is send_recv over broadcast_lb (how much the "
        "load-balanced broadcast gains), `lb / bound` how close it comes to the bound. Methods whose "
        "schedules are the same chains share their times.", "",
        table(["case", *methods, "NIC bound s", "sr / lb", "lb / bound", "picked", "fastest", "correct"], rows), "",
        *summary, "",
        "Where broadcast_lb's chains would share a NIC it runs them in rounds that share none (the cost model "
        "charges shared NICs a contention term, `cost_models/flows.py`)."])


def capture_section(d: Json) -> str:
    rows = []
    ratios = []
    for preset, r in d["presets"].items():
        base = r.get("baseline") or {}
        if r.get("ratio") is not None:
            ratios.append(r["ratio"])
        rows.append([preset, num(r["seconds"], 2), num(r["peak_rss_gib"], 2), f"{r['params']:,}", r["ops"],
                     f"{r['flops'] / 1e9:,.1f}", num(base.get("seconds"), 2), base.get("ops", "-"),
                     num(r.get("ratio"), 2)])
    against = d.get("against")
    return "\n".join([
        "Every zoo preset exported on FakeTensors (nothing allocated), lowered to the op surface, replayed on "
        "meta tensors to count forward and backward FLOPs per op, and checked against the sharding rules; each "
        "capture in a fresh process (time includes `torch.export` and the lowering; peak is the process's peak "
        f"RSS, torch included). Medians of {d.get('repeats', 1)} captures"
        + (f", interleaved with the code of `{against}` (\"before\" columns; \"new / before\" is the time ratio)"
           if against else "") + ".", "",
        table(["preset", "seconds", "peak GiB", "parameters", "ops", "GFLOP per step", "before s", "ops before",
               "new / before"], rows), "",
        (f"new / before: median {x(statistics.median(ratios))}, range {x(min(ratios))}-{x(max(ratios))}. "
         if ratios else "")
        + "A graph that is already functional is decomposed node by node rather than retraced as a whole "
          "(`run_decompositions`), which would cost far more on the large presets."])


def families_section(d: Json) -> str:
    rows = []
    for r in d["rows"]:
        check = r.get("check") or {}
        f64, f32 = check.get("float64") or {}, check.get("float32") or {}
        rows.append([r["family"], num(r["capture_s"], 1), r["ops"], len(r.get("fallback_ops") or []),
                     num(r.get("plan_s"), 1), num(r.get("predicted_ms"), 1), r.get("split_ops", "-"),
                     "OK" if f64.get("ok") else ("FAILED" if f64 else "-"), sci(f64.get("loss_rel")),
                     sci(f64.get("worst_diff")), sci(f32.get("loss_rel")),
                     "OK" if f32.get("ok") else ("beyond tolerance" if f32 else "-")])
    ok64 = sum(1 for r in d["rows"] if (r.get("check") or {}).get("float64", {}).get("ok"))
    fallback = sum(1 for r in d["rows"] if r.get("fallback_ops"))
    return "\n".join([
        "HuggingFace architectures (`hf:<model_type>`), torch.nn families (`torch:<family>`) and the zoo's tiny "
        "presets, each built from a small config (nothing downloaded), captured without the replicated "
        f"fallback, planned for {d.get('cluster', 'the emulated cluster')} and checked as `hetsynth run --check` "
        f"does ({d.get('steps', '?')} AdamW steps on gloo ranks): the float64 twin decides (loss relative "
        "difference and the largest parameter or buffer difference against the single-device model), the "
        "plan's float32 run is information. \"ops split\" counts the ops the plan shards.", "",
        f"{len(d['rows'])} families; {ok64} pass the float64 check; {fallback} need a fallback op.", "",
        table(["family", "capture s", "ops", "fallback ops", "plan s", "predicted ms", "ops split",
               "check (float64)", "loss rel. f64", "max param/buffer f64", "loss rel. f32", "float32"], rows), "",
        "A float32 loss far from the single-device one with a matching float64 twin (MobileNetV2's BatchNorms "
        "over few values per channel) is float32 rounding amplified by the model, not a wrong program."])


def llama_section(d: Json) -> str:
    fields = [("capture s", "capture_s", 1), ("planning s", "plan_s", 1), ("total s", "total_s", 1),
              ("ops", "ops", None), ("parameters", "params", None), ("search states", "states", None),
              ("predicted step s", "predicted_s", 1), ("fullest device GiB", "max_memory_gib", 1)]
    cols = [k for k in ("plan_only", "with_baselines") if k in d]
    rows = [[label, *[(f"{d[c][key]:,}" if digits is None else num(d[c][key], digits)) for c in cols]]
            for label, key, digits in fields]
    return "\n".join([
        f"`{d['ref']}`: a Llama of the 8B shape (grouped-query attention), shape only, captured and planned for "
        "hap-paper (64 GPUs, 8 x 8 mesh) in a fresh process, with the saved-tensor memory model; \"with "
        "baselines\" also plans DP-EV, DP-CP and Megatron.", "",
        table(["", *[c.replace("_", " ") for c in cols]], rows)])


def synthesis_section(d: Json) -> str:
    layers = [v for k, v in d.items() if k[:1].isdigit()]
    scale = [v for k, v in d.items() if k.startswith("gpt-scale/")]
    pipe = [v for k, v in d.items() if k.startswith("gpt-pipeline/") and "layers" in v and "spmd_seconds" in v]
    growth = d.get("gpt-pipeline/growth/wall")
    dp_only = [v for k, v in d.items() if k.startswith("gpt-pipeline/dp-only/")]
    out = ["ViT (`vit:paper`, batch 8 per device) with 1 to 64 layers on the first 8 devices of the HAP cluster "
           "(one V100 node) and on all 64 (8 x 8 mesh, two-level layouts), each point in a fresh process; "
           "synthesis is the whole alternation of A* search and ratio LP. A run of repeated blocks is searched block "
           "by block and a block whose start repeats reuses the search before it (`planner/periodic.py`), so the "
           "states expanded stop growing with depth; what still grows is the work per op outside the search "
           "(costing, the ratio LP, the predictions).", ""]
    out.append(table(["devices", "layers", "ops", "synthesis s", "states expanded", "rounds", "peak GiB"],
                     [[r["devices"], r["layers"], r.get("ops", "-"), num(r["seconds"], 2),
                       f"{r['states_expanded']:,}", r.get("rounds", "-"), num(r.get("peak_rss_gib"), 2)]
                      for r in layers]))
    if scale:
        out += ["", "Scale: GPT (`gpt:paper`, 12 layers, 32 sequences per device) on hap-paper's node kinds scaled "
                    "to more nodes of 8 GPUs (made by the bench with `ClusterSpec.scaled`). Synthesis time does not "
                    "grow with the number of devices: the planner works on classes of interchangeable devices, "
                    "and the rest of its work depends on the model.", "",
                table(["devices", "device classes", "synthesis s", "states expanded", "rounds", "predicted ms",
                       "peak GiB"],
                      [[r["devices"], r.get("device_classes", "-"), num(r["seconds"], 2), f"{r['states_expanded']:,}",
                        r.get("rounds", "-"), ms(r.get("predicted_step_s")), num(r.get("peak_rss_gib"), 2)]
                       for r in scale])]
    if pipe:
        out += ["", "Pipelines: `gpt:paper` (batch 256) with 6 to 48 layers on the whole hap-paper cluster (64 "
                    "devices), planned as `hetsynth plan --stages auto` does: the SPMD plan (capture, search, LP, "
                    "baselines), then the stage search, split into the stage DP (`planner/stage_dp.py`) and the "
                    "stage synthesis (micro-batch capture, each stage's search and LP on its sub-cluster, the "
                    "schedule simulation). The faster shape is kept.", "",
                table(["layers", "ops", "segments", "SPMD plan s", "stage DP s", "stage synthesis s", "total s",
                       "total CPU s", "pipeline found", "SPMD ms", "pipeline ms", "kept"],
                      [[r["layers"], r["ops"], r["segments"], num(r["spmd_seconds"], 2),
                        num(r["stage_dp_seconds"], 2), num(r["stage_synthesis_seconds"], 2), num(r["seconds"], 2),
                        num(r.get("cpu_seconds"), 2),
                        f"{r['stages']} st, M={r['micro_batches']}, {r['schedule']}", ms(r["spmd_step_s"]),
                        ms(r["pipeline_step_s"]), r.get("shape", "-")] for r in pipe])]
    if growth:
        out += ["", "Growth with depth, fitted as t = c L^k over the layer counts above (wall time):", "",
                table(["part", "k", "s per layer"],
                      [[part, num(g["exponent"], 2), num(g["seconds_per_layer"], 2)] for part, g in growth.items()])]
    shapes = [v for k, v in d.items() if k.startswith("shape/")]
    if shapes:
        out += ["", "Real model shapes: a Llama-3-8B shape (32 layers, hidden 4096, GQA 32/8, FFN 11008, sequence 512) "
                    "and a 70B one (80 layers, hidden 8192, GQA 64/8, FFN 28672) on hap-paper (64 devices) and on it "
                    "scaled to 1,024, batch max(64, devices). `hetsynth plan` is the whole command in a fresh process "
                    "with no plan cache (what a user waits for); the parts are measured in another process.", "",
                table(["model", "devices", "ops", "hetsynth plan s", "capture s", "SPMD plan s", "of it search s",
                       "baselines s", "predicted ms", "peak GiB"],
                      [[r["model"], r["devices"], r.get("ops", "-"),
                        num(r.get("command_seconds"), 1) if "command_error" not in r else "error",
                        num(r.get("capture_seconds"), 1), num(r.get("plan_seconds"), 1), num(r.get("search_seconds"), 1),
                        num(r.get("baselines_seconds"), 1), ms(r.get("predicted_step_s")),
                        num(max((r[k] for k in ("peak_rss_gib", "command_peak_rss_gib") if k in r), default=None), 2)]
                       for r in shapes])]
        errors = [f"{r['model']} on {r['devices']}: {r['command_error']}" for r in shapes if "command_error" in r]
        out += [""] + [f"`hetsynth plan` ended with: {e}" for e in errors] if errors else []
    for r in dp_only:
        out += ["", f"The stage DP alone at {r['layers']} layers ({r['ops']:,} ops, {r['segments']} segments): "
                    f"{num(r['stage_dp_seconds'], 2)} s; it coarsens cuts to a bounded number of segments. "
                    f"Best: {r['best'].split(':')[0]}."]
    return "\n".join(out)


def plan_quality_section(d: Json) -> str:
    rows = []
    for key, r in d.items():
        if key == "meta" or not isinstance(r, dict):
            continue
        model, _, cluster = key.partition("/")
        if "error" in r:
            rows.append([model, cluster, "error", "", "", "", "", ""])
            continue
        b = r["baselines"]

        def cell(name: str) -> str:
            v = b[name]
            return ms(v["step_time_s"]) + ("" if v.get("fits", True) else " (does not fit)")

        fitting = [v["step_time_s"] for v in b.values() if v.get("fits", True)]
        best = min(fitting) / r["hetsynth_s"] if fitting else None
        rows.append([model, cluster, ms(r["hetsynth_s"]) + ("" if r.get("fits", True) else " (does not fit)"),
                     cell("dp_ev"), cell("dp_cp"), cell("megatron"), x(best), num(r.get("synthesis_s"), 1)])
    return "\n".join([
        "Predicted step time (the same cost model for all) of hetsynth's plan and the three baselines for every "
        "zoo model's paper preset on every shipped cluster (global batch 32 per device; the emulated cluster "
        "with the `small-cpu` presets). \"vs best baseline\" is the fastest baseline that fits over hetsynth "
        "(above 1x: hetsynth's plan is faster). On VGG19 it finds the hybrid HAP reports (batch-split "
        "convolutions, tensor-parallel classifier); on the homogeneous `a100x8` the ratios are even and the "
        "margins over data parallelism small, except on VGG19's classifier. `python bench/compare_plan_quality.py "
        "OLD NEW` compares two such files.", "",
        table(["model", "cluster", "hetsynth ms", "DP-EV ms", "DP-CP ms", "Megatron ms", "vs best baseline",
               "synthesis s"], rows)])


MEASURED_BASELINES = {"DDP-EV": "ddp_ev_s", "DDP-CP": "ddp_cp_s", "DP-EV": "dp_ev_s", "DP-CP": "dp_cp_s"}


def best_baseline(r: Json) -> tuple[str, float]:
    name = r.get("best_baseline") or min(MEASURED_BASELINES, key=lambda n: r[MEASURED_BASELINES[n]])
    return name, r[MEASURED_BASELINES[name]]


def ranged(ratio: Json, fmt: Callable[[Any], str]) -> str:
    """'median (min-max)' of a {median, min, max} ratio."""
    return f"{fmt(ratio['median'])} ({fmt(ratio['min'])} to {fmt(ratio['max'])})"


def measured_speedup_section(d: Json) -> str:
    rows = []
    for model, r in d["models"].items():
        name, best = best_baseline(r)
        h = r["hetsynth_s"]
        if "ratios" in r:  # medians of several runs, each ratio's range
            q = r["ratios"]
            ratios = [ranged(q["vs_ddp_ev"], x), ranged(q["vs_ddp_cp"], x),
                      f"{ranged(q['vs_best_baseline'], x)} ({name})", num(r["predicted_s"]),
                      ranged(q["prediction_error"], pct)]
        else:
            ratios = [x(r["ddp_ev_s"] / h), x(r["ddp_cp_s"] / h), f"{x(best / h)} ({name})", num(r.get("predicted_s")),
                      pct((r["predicted_s"] - h) / h) if r.get("predicted_s") is not None else "-"]
        rows.append([model, num(h), num(r["ddp_ev_s"]), num(r["ddp_cp_s"]), num(r["dp_ev_s"]), num(r["dp_cp_s"]),
                     *ratios])
    runs = len(d.get("runs", [])) or 1
    return "\n".join([
        f"`{d.get('cluster', 'configs/clusters/local-emulated.toml')}` emulated on one machine (root): two nodes in "
        "network namespaces with a 200 Mbit/s shaped link, two workers at 0.5 CPU and two at 0.25 CPU (cgroup "
        "quotas), one torch thread each. The cluster is profiled first (`hetsynth profile`, written to "
        f"`{d.get('measured_spec', 'bench/results/local-emulated-measured.toml')}`) and every plan is made for "
        "the measured spec with `--measure-ops`. hetsynth's plan, DP-EV and DP-CP (hetsynth's data-parallel "
        "programs with even and throughput-proportional rows) and torch's `DistributedDataParallel` on the plain "
        "model with the same rows (DDP-EV as users run it; DDP-CP with the loss weights that make uneven rows "
        "train the global batch, `runtime/ddp.py`) train on the same workers, interleaved (warm-up, then rounds "
        "of each, batches prefetched). Median seconds per step; speed-ups are baseline / hetsynth (above 1x: "
        "hetsynth is faster); the prediction error is (predicted - measured) / measured. "
        f"{runs_text(runs).capitalize()}, each planning and measuring anew"
        f"{': the times are medians over the runs, each ratio its median (min to max)' if runs > 1 else ''}.", "",
        table(["model (small-cpu)", "hetsynth s", "DDP-EV s", "DDP-CP s", "DP-EV s", "DP-CP s", "vs DDP-EV",
               "vs DDP-CP", "vs best baseline", "predicted s", "prediction error"], rows)])


MEMORY_LABELS = {"hetsynth": "hetsynth", "fsdp_even": "FSDP2, even rows",
                 "fsdp_even_ckpt": "FSDP2, even rows, checkpointing",
                 "fsdp_prop": "FSDP2, proportional rows and loss weights",
                 "fsdp_prop_ckpt": "FSDP2, proportional, checkpointing", "ddp": "torch DDP, even rows",
                 "ddp_cp": "torch DDP, proportional rows"}


def _mib(values: list[float] | None) -> str:
    return " ".join(f"{v:.0f}" for v in values) if values else "-"


def memory_bound_section(d: Json) -> str:
    runs = d["runs"]
    rows = []
    for config, s in d["summary"].items():
        medians = [r[config]["median_s"] for r in runs if r.get(config, {}).get("ok")]
        failures = sorted({f.split(": ", 1)[-1].split(" (")[0] for f in s.get("failures", [])})
        oom = sorted({rank for r in runs for rank in r.get(config, {}).get("out_of_memory_ranks", [])})
        result = "fits" if s["fit_runs"] == s["runs"] else (
            f"fits in {s['fit_runs']} of {s['runs']}" if s["fit_runs"] else
            f"fails: {'; '.join(failures)}" + (f" (ranks {', '.join(map(str, oom))})" if oom else ""))
        rows.append([MEMORY_LABELS.get(config, config), f"{s['fit_runs']}/{s['runs']}",
                     spread(medians, num) if medians else "-", _mib(s.get("peak_mib_by_rank")), result])
    limits = next((r[c]["limit_mib_by_rank"] for r in runs for c in r if r[c].get("limit_mib_by_rank")), None)
    predicted = [r["hetsynth"]["predicted"] for r in runs if r.get("hetsynth", {}).get("predicted")]
    ratios = d.get("ratios", {})
    labels = {"vs_fsdp_best": "fastest FSDP2 that fits / hetsynth (step time)",
              "prediction_error": "hetsynth's step prediction error, (predicted - measured) / measured",
              "peak_prediction_error": "hetsynth's peak memory prediction error, the rank where it is largest"}
    ratio_rows = [[labels.get(k, k), x(v["median"]) if k.startswith("vs") else pct(v["median"]),
                   (f"{x(v['min'])}-{x(v['max'])}" if k.startswith("vs") else f"{pct(v['min'])} to {pct(v['max'])}"),
                   runs_text(len(runs))] for k, v in ratios.items()]
    cluster = d.get("cluster", "")
    cluster = cluster.split("/configs/", 1)[-1] if "/configs/" in cluster else cluster
    cluster = f"configs/{cluster}" if not cluster.startswith("configs/") and "clusters/" in cluster else cluster
    out = [f"`{cluster}`: two workers at 0.5 CPU and two at 0.25 CPU with cgroup memory limits "
           f"({_mib(limits)} MiB by rank), 200 Mbit/s between the nodes; the model is `{d['model']}`. hetsynth's "
           "plan (it shards training state where memory binds) against torch FSDP2 with even or "
           "throughput-proportional rows, with and without activation checkpointing, and torch DDP. Each "
           "configuration runs in its own launch (an out-of-memory kill loses only it), in a rotated order per "
           f"run; {d.get('warmup', '?')} warm-up and {d.get('rounds', '?')} timed steps each. The step column is "
           "the median over runs of each run's median step (range in brackets); peaks are the cgroups' peaks, "
           "median over runs.", "",
           table(["configuration", "fits (runs)", "median step s", "peak MiB per rank", "result"], rows), "",
           table(["ratio", "median", "range", "runs"], ratio_rows)]
    if predicted:
        spec = d.get("measured_spec")
        out += ["", f"hetsynth's prediction (run 1): {num(predicted[0]['step_s'])} s per step, "
                    f"{_mib(predicted[0]['peak_mib_by_rank'])} MiB by rank"
                + (f", planned for the measured spec `{Path(spec).name}` with the model's ops timed here." if spec
                   else ".")
                + " Every configuration builds the model whole on the host and places its part on the device, "
                  "so the peaks are the training's (runtime.emulation.host_memory)."]
    return "\n".join(out)


def ddp_overhead_section(d: Json) -> str:
    envs = list(d["summary"])
    names = {"ratio": "hetsynth / torch DDP", "parallelize_ratio": "hetsynth.parallelize in a user's loop / hetsynth run"}
    rows = []
    for env in envs:
        devices = next((r[env].get("devices") for r in d["runs"] if env in r), None)
        for key, s in d["summary"][env].items():
            rows.append([f"{env} ({devices} ranks)" if devices else env, names.get(key, key), x(s["median"], 3),
                         f"{x(s['min'], 3)}-{x(s['max'], 3)}", runs_text(len(d["runs"]))])
    per_run = []
    for i, run in enumerate(d["runs"], 1):
        for env in envs:
            r = run.get(env)
            if r:
                per_run.append([i, env, num(r["hetsynth_s"], 4), num(r["ddp_s"], 4), num(r.get("one_bucket_s"), 4),
                                num(r.get("parallelize_s"), 4), x(r["ratio"], 3), x(r.get("parallelize_ratio"), 3)])

    def phases(p: Json, ddp: bool = False) -> str:
        if not p:
            return "-"
        parts = [f"forward {ms(p.get('forward'))}",
                 f"backward{' (with its sync)' if ddp else ''} {ms(p.get('backward'))}"]
        if not ddp:
            parts.append(f"sync wait {ms(p.get('gradient_sync'))}")
        parts.append(f"update {ms(p.get('update'))}")
        return ", ".join(parts)

    phase_rows = []
    for env in envs:
        runs = sorted((r[env] for r in d["runs"] if env in r), key=lambda r: r["ratio"])
        r = runs[len(runs) // 2]  # the run with the median ratio
        ph = r.get("phases", {})
        phase_rows.append([env, phases(ph.get("hetsynth", {})), phases(ph.get("one_bucket", {})),
                           phases(ph.get("ddp", {}), ddp=True)])
    return "\n".join([
        f"hetsynth's data-parallel plan (even ratios) and torch's `DistributedDataParallel` on the plain model "
        f"train `{d['model']}` from the same initialisation on the same rows with the same AdamW and clipping, "
        f"interleaved in one launch (warm-up, then {d['rounds']} rounds of {d['steps']} steps each; medians). "
        "`local`: plain processes on this machine; `emulated`: an equal-quota copy of `local-emulated.toml` (two "
        "nodes of two workers, all at 0.25 CPU, 200 Mbit/s between the nodes), made by the bench. Beside the "
        "plan (the bucket cap the cost model chooses) the same program trains with one gradient bucket, which "
        "starts only after the whole backward (no overlap), and the plan's module (what `hetsynth.parallelize` "
        "returns) trains in a user's loop (torch AdamW, backward, `clip_grad_norm_`, step, `zero_grad`). Each "
        "run is an independent launch; ratios are step-time ratios (below 1x: hetsynth is faster).", "",
        table(["environment", "ratio", "median", "range", "runs"], rows), "",
        "Every run (median seconds per step):", "",
        table(["run", "environment", "hetsynth s", "torch DDP s", "one bucket s", "parallelize s",
               "hetsynth / DDP", "parallelize / run"], per_run), "",
        "Phases on rank 0 (ms, medians), from the run with the median hetsynth / DDP ratio. DDP waits for its "
        "last bucket inside its backward; hetsynth's sync wait is the wait after the backward, which the plan's "
        "buckets (launched during the backward) shorten against one bucket:", "",
        table(["environment", "hetsynth", "one bucket", "torch DDP"], phase_rows)])


def sfb_section(d: Json) -> str:
    rows = []
    for name, c in d["cases"].items():
        wire = c.get("wire_bytes_per_step", {})
        rows.append([name, len(c.get("sfb_weights", [])), len(c.get("dp_picks_sfb", [])),
                     len(c.get("hetsynth_picks_sfb", [])), num(wire.get("dp_sfb", 0) / 2**20, 2),
                     num(wire.get("dp_allreduce", 0) / 2**20, 2),
                     f"{num(c['dp_sfb_s'])} ({num(c.get('predicted_dp_sfb_s'))})",
                     f"{num(c['dp_allreduce_s'])} ({num(c.get('predicted_dp_allreduce_s'))})",
                     x(c["dp_allreduce_s"] / c["dp_sfb_s"]),
                     f"{num(c['hetsynth_s'])} ({num(c.get('predicted_hetsynth_s'))})"])
    gpt = d.get("gpt_plans_sfb_weights", {})
    return "\n".join([
        "Sufficient-factor broadcasting on the emulated cluster: each case trains three plans interleaved on the "
        "same workers: data parallelism with SFB forced on every linear weight, the same plan with those weights "
        "all-reduced instead (`planner.planner.without_sfb`: same layouts, ratios and shard lengths), and "
        "hetsynth's own plan. \"DP picks SFB\": how many weights data parallelism gives SFB when the cost model "
        "decides (what `hetsynth plan --data-parallel` writes). Step seconds are medians, predictions in "
        "brackets; wire is the bytes the two nodes' NICs sent per step; the SFB speed-up is all-reduce / SFB.", "",
        table(["case", "linears", "DP picks SFB", "hetsynth picks SFB", "wire MiB/step SFB",
               "wire MiB/step all-reduce", "step s SFB (pred.)", "step s all-reduce (pred.)", "SFB speed-up",
               "hetsynth plan s (pred.)"], rows), "",
        "SFB pays where the weights are big against the batch (VGG's classifier at 32 images); at large batches "
        "the factors outweigh the gradient and data parallelism does not pick it. hetsynth's own plans split the "
        "classifier instead (column- then row-parallel), cheaper still."
        + (" SFB weights in hetsynth's own GPT plans: "
           + "; ".join(f"{k}: {len(v)}" for k, v in gpt.items()) + "." if gpt else "")])


VARIANTS = ["unfused", "sliced2", "sliced4", "fused"]


def _variant_s(c: Json, v: str) -> float:
    return c["unfused_s"] if v == "unfused" else c["fused_s"] if v == "fused" else c["sliced_s"][v[-1]]


def overlap_section(d: Json, instructions: Json | None) -> str:
    rows = []
    hidden = picks_ok = 0
    where = []
    worst_fused_over_unfused = 0.0
    for c in d["cases"]:
        times = {v: _variant_s(c, v) for v in VARIANTS}
        fastest = min(times, key=times.get)
        ok = times[c["picked"]] <= 1.1 * times[fastest]
        picks_ok += ok
        worst_fused_over_unfused = max(worst_fused_over_unfused, times["fused"] / times["unfused"])
        e, em = c.get("exposed", {}), c.get("exposed_of_medians", {})
        interval = c.get("fused_exposed_90")
        if c.get("measured_step_ratio", 2) <= 1:
            where.append(c["name"])
            hidden += e.get("fused", 1) <= 0.15
        rows.append([c["name"], ms(c["matmul_s"]), ms(times["unfused"]), ms(times["sliced2"]), ms(times["sliced4"]),
                     ms(times["fused"]), ms(c.get("predicted_fused_s")), num(e.get("sliced2"), 2),
                     num(e.get("sliced4"), 2), num(e.get("fused"), 2),
                     f"{num(interval[0], 2)}..{num(interval[1], 2)}" if interval else "-",
                     num(em.get("fused"), 2), num(c.get("model_step_ratio"), 2), num(c.get("measured_step_ratio"), 2),
                     c["picked"], fastest, "yes" if ok else "NO"])
    out = [
        "Fused collective-matmuls (CommFuse) on two emulated environments generated from the measured "
        "local-emulated spec: `inside`, two 0.5-CPU workers in one node over loopback; `across`, one on each of "
        "two nodes joined by the 200 Mbit/s link. For all-gather -> matmul (`ag`, the size is the output "
        "features) and matmul -> reduce-scatter (`rs`, the size is the contraction), even and 2:1 (`skewed`) "
        "shards, the worker times the matmul alone, the unfused pair (padded collective + the same chunked "
        "matmul), k-slicing (k = 2, 4) and the fused ring, interleaved; medians of the slowest rank, in ms.", "",
        "How to read it: \"exp\" is the exposed communication, (variant - matmul) / (unfused - matmul), each "
        "difference paired by repetition (0: the communication is hidden entirely; 1: not at all); \"exp fused "
        "90%\" its 90% interval over bootstrap resamples of whole repetitions; \"exp fused (medians)\" the ratio "
        "of the medians beside it. \"t_p/t_c\" is a ring step's communication over its matmul, by the cost model "
        "and measured (the ring can hide a step's communication only where it is <= 1). \"picked\" is the cost "
        "model's choice among the four, \"ok\" when it measured within 10% of the fastest.", "",
        table(["case", "matmul ms", "unfused ms", "sliced2 ms", "sliced4 ms", "fused ms", "pred fused ms", "exp s2",
               "exp s4", "exp fused", "exp fused 90%", "exp fused (medians)", "t_p/t_c model", "t_p/t_c meas",
               "picked", "fastest", "ok"], rows), "",
        f"- where the measured t_p/t_c <= 1 ({len(where)} cases) the fused exposure is <= 0.15 in {hidden};",
        f"- the fused ring takes at most {x(worst_fused_over_unfused)} the unfused pair's time;",
        f"- the cost model's pick is within 10% of the measured fastest in {picks_ok} of {len(d['cases'])} cases."]
    e2e = d.get("end_to_end")
    if e2e:
        out += ["", f"End to end: `{e2e['model']}` on `{e2e['env']}`, {e2e['plan']} ({e2e['fused_instructions']} "
                    "fused instructions the cost model chose), against the same plan without fusion "
                    "(`planner.planner.without_fusion`), trained interleaved (`runtime.compare`), medians over "
                    f"{e2e.get('steps', '?')} steps:", "",
                table(["plan", "measured s/step", "predicted s/step", "error"],
                      [["fused", num(e2e["fused_s"]), num(e2e["predicted_s"]),
                        pct((e2e["predicted_s"] - e2e["fused_s"]) / e2e["fused_s"])],
                       ["unfused", num(e2e["unfused_s"]), num(e2e["predicted_unfused_s"]),
                        pct((e2e["predicted_unfused_s"] - e2e["unfused_s"]) / e2e["unfused_s"])]]), "",
                f"Fused / unfused, median of the per-step ratios: {num(e2e.get('fused_over_unfused_median'), 2)}."]
    if instructions:
        by_kind: dict[str, list[float]] = {}
        for i in instructions["instructions"]:
            acc = by_kind.setdefault(i["kind"], [0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += i["predicted_s"]
            acc[2] += i["measured_s"]
        step = instructions["step"]
        rows = [[kind, n, ms(p), ms(m)] for kind, (n, p, m) in by_kind.items()]
        rows += [[b["name"], "-", ms(b["predicted_s"]), ms(b["measured_s"])] for b in instructions.get("bulk", [])]
        rows.append(["whole step", "-", ms(step["predicted_s"]), ms(step["measured_s"])])
        out += ["", f"Where the fused plan's step goes (its traced steps, `bench/results/overlap_e2e_instructions.json`, "
                    f"plan {instructions.get('plan_digest', '?')}): predicted against measured ms per step, summed over "
                    "the instructions of each kind, then the phases outside instructions and the whole step:", "",
                table(["instructions", "count", "predicted ms", "measured ms"], rows), "",
                meta_block(instructions, "overlap_e2e_instructions.json")]
    return "\n".join(out)


def collectives_section(d: Json) -> str:
    score_rows = []
    miss_rows = []
    for env, e in d["environments"].items():
        s = e["score"]
        score_rows.append([env, s["right"], s["total"], f"{100 * s['right'] / s['total']:.0f}%"])
        groups: dict[tuple, dict[str, Json]] = {}
        for r in e["records"]:
            op, _, variant = r["case"].partition(".")
            groups.setdefault((op, r["bytes"], tuple(r["shares"])), {})[variant] = r
        for (op, size, shares), variants in groups.items():
            if len(variants) < 2:
                continue
            fastest = min(variants, key=lambda v: variants[v]["seconds"])
            picked = min(variants, key=lambda v: variants[v]["predicted"])
            if variants[picked]["seconds"] > 1.1 * variants[fastest]["seconds"]:
                miss_rows.append([env, op, f"{size / 2**20:g}", num(max(shares), 2), picked,
                                  ms(variants[picked]["seconds"]), fastest, ms(variants[fastest]["seconds"])])
    overall = d.get("overall", {})
    out = ["Every variant of all-gather and reduce-scatter (padded, grouped broadcast/reduce, ring), the all-reduce "
           "and the all-to-all, timed on 4 ranks for skews from even to 90% on the first rank and messages from "
           "64 KiB to 64 MiB, on the emulated cluster and on 4 plain local processes, each profiled first "
           "(`hetsynth profile`, fits in `bench/results/collectives-*-measured.toml`). A pick counts as right when "
           "the variant with the lowest predicted time measures within 10% of the fastest; a repetition is timed "
           "until the last rank is done.", "",
           table(["environment", "right picks", "cases", "share"], score_rows)
           + (f"\n| overall | {overall['right']} | {overall['total']} | "
              f"{100 * overall['right'] / overall['total']:.0f}% |" if overall else ""), ""]
    if miss_rows:
        out += ["The misses (picked variant measured more than 10% slower than the fastest):", "",
                table(["environment", "collective", "MiB", "largest share", "picked", "picked ms", "fastest",
                       "fastest ms"], miss_rows), ""]
    out += ["Plain local processes are four processes on two cores with no quotas: there the alpha-beta form "
            "describes the collectives only roughly and the same case moves between runs, so the local count is "
            "noisy; on the emulated cluster the model gets the times right, not only the order. The full table "
            "(measured and predicted time of every variant) is in the JSON and printed by the command."]
    return "\n".join(out)


def trace_overhead_section(d: Json, render: Json | None) -> str:
    paired = [t / u for t, u in zip(d["traced_step_s"], d["untraced_step_s"])]
    out = [f"What `hetsynth run --trace` costs a step, on the demo's plan (`{d['model']}`, planned as `make demo` "
           f"plans it, on the {'emulated' if d.get('emulated') else 'local, NOT emulated,'} cluster): in each of "
           f"{d['rounds']} rounds one plain step, then one step with every instruction timed "
           f"({d['timed_instructions']} instructions on each of {d['num_devices']} ranks), on the same workers and "
           "trainer, each after a barrier; step time is rank 0's.", "",
           table(["steps", "median ms", "vs untraced"],
                 [["untraced", ms(d["untraced_median_s"]), "1.000"],
                  ["traced (every instruction timed)", ms(d["traced_median_s"]), num(d["ratio_of_medians"])]]), "",
           f"Median of the {len(paired)} per-round ratios (traced / untraced): {num(d['median_paired_ratio'])}; "
           f"single rounds range from {num(min(paired), 2)} to {num(max(paired), 2)} (the emulated cluster's step "
           "times vary by that much from step to step). The traced steps' losses and parameters are those of "
           "untraced training (tests/test_trace.py, float64)."]
    if render:
        out += ["", "The HTML report of the demo's plan (`hetsynth report`, with its measured trace) rendered in "
                    f"headless Chromium (`python bench/report_render.py`): a {render['size'][1]}x{render['size'][0]} "
                    f"screenshot with {render['compute_pixels']:,} pixels of compute slices and "
                    f"{render['communication_pixels']:,} of communication slices ({render['timelines']} timelines), "
                    f"{render['tables']} tables, and {len(render.get('external_references', [])) or 'no'} external "
                    "references in the file.", "", meta_block(render, "report_render.json")]
    return "\n".join(out)


def reliability_section(d: Json) -> str:
    rows = [[f["fault"], f["plan"], f["exit"], num(f["seconds"], 1), f"`{TMP_PATH.sub('.../', f['line'])}`",
             "yes" if f.get("traceback") else "no"] for f in d["faults"]]
    runs = d.get("runs", [])
    exits: dict[int, int] = {}
    for r in runs:
        exits[r["exit"]] = exits.get(r["exit"], 0) + 1
    noisy = sum(1 for r in runs if r.get("noise"))
    out = ["Every fault ends `hetsynth run` with the rank named on its last line, nothing left running and no "
           f"traceback; seconds from the fault to the command's exit, on the {'emulated' if d.get('emulated') else 'local'} "
           "cluster, GPT tiny, `--timeout 10`, the default (two-level) plan and a single-level plan on the first "
           "node's two devices. A stopped or killed rank is signalled from outside once step 2 is printed; a "
           "raising rank raises at the start of the next step.", "",
           table(["fault", "plan", "exit", "seconds to exit", "last line", "traceback"], rows)]
    if runs:
        out += ["", f"Repeated runs: {len(runs)} emulated runs in a row; exit codes "
                    + ", ".join(f"{code}: {n}" for code, n in sorted(exits.items()))
                    + f"; {noisy} printed anything unexpected (a traceback or a warning); median "
                    f"{num(statistics.median(r['seconds'] for r in runs), 1)} s a run."]
    out += ["", "A stopped rank costs the timeout plus a few seconds: the other ranks' collectives time out, the "
                "launcher gives the agents 2 s to stop by themselves and then kills everything."]
    return "\n".join(out)


def moe_experts_section(d: Json) -> str:
    s, n = d["summary"], len(d["runs"])

    def cell(name: str, key: str, fmt: Callable[[Any], str]) -> str:
        return spread([r[name][key] for r in d["runs"]], fmt)

    rows = [[name, s[name].get("local") or "whole", "/".join(map(str, s[name]["experts"])), cell(name, "measured_s", num),
             cell(name, "predicted_s", num), cell(name, "error", lambda v: f"{v:+.1%}"),
             cell(name, "vs_replicated", x)] for name in s]
    return "\n".join([
        f"`{d['model']}` on `{d['cluster']}` (2 x 0.5 CPU + 2 x 0.25 CPU, 200 Mbit/s between the nodes), "
        "measured spec, ops timed: the planner's own plan (**chosen**), the experts split with the tokens "
        "all-gathered to them (**gathered**, `experts_sharded`) or sent to them pair by pair by all-to-all "
        "(**dispatched**, `experts_dispatched`), the best plan with every expert weight replicated "
        "(**replicated**: the experts train data-parallel) and DP-CP, trained interleaved; median seconds per "
        "step over "
        f"{runs_text(n)} (planning included in each), median (range). Error: (predicted - measured) / measured.", "",
        table(["plan", "experts", "experts per rank", "measured s", "predicted s", "error", "replicated / it"],
              rows)])


# (anchor, title, result file, renderer, extra result files passed along)
SECTIONS: list[tuple[str, str, str, Callable[..., str], tuple[str, ...]]] = [
    ("pipeline", "Pipelines on a slow link", "pipeline.json", pipeline_section, ()),
    ("resharding", "Cross-mesh resharding", "resharding.json", resharding_section, ()),
    ("capture", "Capture", "capture.json", capture_section, ()),
    ("families", "Model families from their configs", "families.json", families_section, ()),
    ("llama-scale", "Llama at the 8B shape", "llama_scale.json", llama_section, ()),
    ("synthesis-time", "Synthesis time", "synthesis_time.json", synthesis_section, ()),
    ("plan-quality", "Plan quality (predicted)", "plan_quality.json", plan_quality_section, ()),
    ("measured-speedup", "Measured speed-ups on the emulated cluster", "measured_speedup.json",
     measured_speedup_section, ()),
    ("moe-experts", "Expert parallelism against replicated experts", "moe_experts.json", moe_experts_section, ()),
    ("memory-bound", "Where memory binds: hetsynth against torch FSDP2", "memory_bound.json",
     memory_bound_section, ()),
    ("ddp-overhead", "Overhead against torch DDP on equal ranks", "ddp_overhead.json", ddp_overhead_section, ()),
    ("sfb", "Sufficient-factor broadcasting, measured", "sfb.json", sfb_section, ()),
    ("overlap", "Fused collective-matmuls (CommFuse), measured", "overlap.json", overlap_section,
     ("overlap_e2e_instructions.json",)),
    ("collectives", "Collective variants: does the cost model pick the fastest?", "collectives.json",
     collectives_section, ()),
    ("trace-overhead", "Tracing overhead", "trace_overhead.json", trace_overhead_section, ("report_render.json",)),
    ("reliability", "Reliability: faults and repeated runs", "reliability.json", reliability_section, ()),
]


def spec_lines(results: Path) -> list[str]:
    lines = []
    for path in sorted(results.glob("*.toml")):
        try:
            spec = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, OSError) as err:
            lines.append(f"- `{path.name}`: not readable ({type(err).__name__})")
            continue
        first = path.read_text().splitlines()[0] if path.read_text() else ""
        source = ""
        if "configs/clusters/" in first:
            source = f", profiled from `configs/clusters/{first.rsplit('configs/clusters/', 1)[1].strip()}`"
        devices = len(spec.get("devices", []))
        use = f"; {SPEC_USES[path.name]}" if path.name in SPEC_USES else ""
        lines.append(f"- `{path.name}`: `{spec.get('name', path.stem)}`, {spec.get('description', 'no description')} "
                     f"({devices} devices; measured by `hetsynth profile`{source}{use}).")
    return lines


def render_readme(results: Path = RESULTS) -> str:
    present = [(a, t, f, fn, extra) for a, t, f, fn, extra in SECTIONS if (results / f).is_file()]
    out = ["# Benchmark results", "",
           "<!-- generated by bench/make_readme.py from bench/results/*.json; do not edit by hand -->", "",
           f"Generated from `bench/results/*.json` by `{REGENERATE}` (`--check` says whether this file is stale). "
           "Every figure below comes from a result file; each section says the command that produced it, when, "
           "on which machine and at which commit (the file's `meta`). The benchmarks run on CPU workers, most on "
           "an emulated heterogeneous cluster (network namespaces, shaped links and CPU quotas; root needed), "
           "so absolute times are of this kind of machine, not of GPUs; the ratios are the point.", ""]
    out += [f"- [{title}](#{anchor})" for anchor, title, *_ in present]
    if any(results.glob("*.toml")):
        out.append("- [Measured cluster specs](#measured-specs)")
    for anchor, title, name, fn, extra in present:
        data = json.loads((results / name).read_text())
        extras = [json.loads((results / e).read_text()) if (results / e).is_file() else None for e in extra]
        out += ["", f'<a id="{anchor}"></a>', "", f"## {title}", "", meta_block(data, name), "",
                fn(data, *extras)]
    specs = spec_lines(results)
    if specs:
        out += ["", '<a id="measured-specs"></a>', "", "## Measured cluster specs", "",
                "Cluster specs measured by `hetsynth profile` that the benchmarks (and `make demo`) read instead of "
                "profiling again; `--reprofile` on a benchmark measures again.", "", *specs]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# the README headline block


def headline_rows(results: Path = RESULTS) -> list[list[str]]:
    rows = []
    memory = json.loads((results / "memory_bound.json").read_text()) if (results / "memory_bound.json").is_file() else None
    if memory and "vs_fsdp_best" in memory.get("ratios", {}):
        r = memory["ratios"]["vs_fsdp_best"]
        limits = next((run[c]["limit_mib_by_rank"] for run in memory["runs"] for c in run
                       if run[c].get("limit_mib_by_rank")), None)
        smallest = f" with {min(limits):.0f} MiB devices" if limits else ""
        ddp = [s for c, s in memory.get("summary", {}).items() if c.startswith("ddp")]
        ddp_fails = bool(ddp) and all(s["fit_runs"] == 0 for s in ddp)
        rows.append([f"Memory-bound GPT on an emulated cluster{smallest}: fastest torch FSDP2 that fits / hetsynth "
                     f"(step time{'; torch DDP runs out of memory' if ddp_fails else ''})", x(r["median"]),
                     f"{x(r['min'])}-{x(r['max'])}",
                     runs_text(len(memory["runs"])), "[memory-bound](bench/README.md#memory-bound)"])
    ddp = json.loads((results / "ddp_overhead.json").read_text()) if (results / "ddp_overhead.json").is_file() else None
    if ddp:
        for env, s in ddp["summary"].items():
            devices = next((r[env].get("devices") for r in ddp["runs"] if env in r), None)
            r = s["ratio"]
            rows.append([f"Overhead on equal ranks ({env}, {devices} ranks): hetsynth / torch DDP (step time; "
                         "1x = none)", x(r["median"], 3), f"{x(r['min'], 3)}-{x(r['max'], 3)}",
                         runs_text(len(ddp["runs"])), "[ddp-overhead](bench/README.md#ddp-overhead)"])
    speed = (json.loads((results / "measured_speedup.json").read_text())
             if (results / "measured_speedup.json").is_file() else None)
    if speed:
        for model, r in list(speed["models"].items())[:6 - len(rows)]:
            name, best = best_baseline(r)
            q = r.get("ratios", {}).get("vs_best_baseline")
            rows.append([f"Heterogeneous emulated cluster, {model} small-cpu: best data-parallel baseline "
                         f"({name}) / hetsynth (step time)", x(q["median"] if q else best / r["hetsynth_s"]),
                         f"{x(q['min'])}-{x(q['max'])}" if q and r.get("runs", 1) > 1 else "-",
                         runs_text(r.get("runs", 1)), "[measured-speedup](bench/README.md#measured-speedup)"])
    return rows[:6]


def render_headline(results: Path = RESULTS) -> str:
    rows = headline_rows(results)
    return "\n".join([
        "Measured on CPU workers of an emulated heterogeneous cluster (see [bench/README.md](bench/README.md) for "
        "every benchmark, its command, date, machine and commit). Ratios above 1x favour hetsynth, except the "
        "overhead rows, where 1x means no overhead.", "",
        table(["measurement", "median", "range", "runs", "details"], rows), ""])


def with_headline(text: str, headline: str) -> str | None:
    """`text` with the block between the markers replaced, or None when the markers are missing."""
    lines = text.split("\n")
    try:
        begin = lines.index(BEGIN)
        end = lines.index(END, begin + 1)
    except ValueError:
        return None
    return "\n".join(lines[:begin + 1] + headline.rstrip("\n").split("\n") + lines[end:])


# ---------------------------------------------------------------------------------------------
# check and write


def _diff(path: Path, old: str, new: str) -> list[str]:
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return list(difflib.unified_diff(old.splitlines(), new.splitlines(), f"{rel} (on disk)",
                                     f"{rel} (from bench/results)", lineterm="", n=1))


def check_readme(results: Path = RESULTS, output: Path = OUTPUT) -> list[str]:
    """What differs between bench/README.md and a fresh render (empty when up to date)."""
    fresh = render_readme(results)
    old = output.read_text() if output.is_file() else None
    if old is None:
        return [f"{output.name} is missing"]
    if old == fresh:
        return []
    return [f"{output.relative_to(ROOT) if output.is_relative_to(ROOT) else output} is stale:"] + _diff(output, old, fresh)


def has_headline_block(readme: Path = TOP_README) -> bool:
    return readme.is_file() and with_headline(readme.read_text(), "") is not None


def check_headline(results: Path = RESULTS, readme: Path = TOP_README) -> list[str]:
    """What differs in README.md's headline block (a missing block is reported too)."""
    text = readme.read_text() if readme.is_file() else ""
    updated = with_headline(text, render_headline(results))
    if updated is None:
        return [f"{readme.name}: no headline block (the lines {BEGIN} and {END}); nothing to fill"]
    if updated == text:
        return []
    return [f"{readme.name}'s headline block is stale:"] + _diff(readme, text, updated)


def check(results: Path = RESULTS, output: Path = OUTPUT, readme: Path = TOP_README) -> list[str]:
    """Problems (empty when bench/README.md and README.md's headline block are up to date)."""
    return check_readme(results, output) + check_headline(results, readme)


def write(results: Path = RESULTS, output: Path = OUTPUT, readme: Path = TOP_README) -> list[str]:
    """Write bench/README.md and fill README.md's headline block; returns what was done."""
    done = []
    output.write_text(render_readme(results))
    done.append(f"wrote {output.relative_to(ROOT) if output.is_relative_to(ROOT) else output}")
    text = readme.read_text() if readme.is_file() else ""
    updated = with_headline(text, render_headline(results))
    if updated is None:
        done.append(f"skipped the headline: {readme.name} has no {BEGIN} ... {END} block")
    elif updated != text:
        readme.write_text(updated)
        done.append(f"updated the headline block of {readme.name}")
    else:
        done.append(f"the headline block of {readme.name} is up to date")
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write bench/README.md (and README.md's headline block) from bench/results")
    p.add_argument("--check", action="store_true", help="exit 1, showing the differences, when either is stale")
    args = p.parse_args(argv)
    if args.check:
        problems = check()
        if problems:
            print("\n".join(problems[:300]), file=sys.stderr)
            print(f"regenerate with {REGENERATE}", file=sys.stderr)
            return 1
        print("bench/README.md and README.md's headline block are up to date")
        return 0
    for line in write():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
