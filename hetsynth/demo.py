"""`make demo`: plan GPT small-cpu for the local emulated cluster, run the plan, DP-EV and
torch's own DDP (DDP-EV: even rows; DDP-CP: throughput-proportional rows with loss weights)
side by side on it, print the measured speed-ups and the parity check against one device.

Steps:
  1. the cluster: configs/clusters/local-emulated.toml, with its measured figures from
     bench/results/local-emulated-measured.toml when that exists (`hetsynth profile` wrote
     it; `--profile` measures again), emulated on this machine (network namespaces, shaped
     links, CPU quotas; runtime.emulation) when root, else plain local processes;
  2. capture the model (its graph summary: op counts, parameters, FLOPs), time its ops here
     (profiling.op_profile) and the whole model on each emulated device kind
     (profiling.model_timing), synthesize the plan and the DP-EV baseline (even batch split);
  3. train the plan, DP-EV and torch DDP-EV and DDP-CP (runtime.ddp) on the same workers,
     interleaved (runtime.compare), and print the median step times, the speed-ups and the
     prediction;
  4. train the single-device model as many steps and compare every step's global loss;
  5. write the plan, its predicted and measured traces (hetsynth's plan is also run traced in
     every round, runtime.compare --traced; the step times with and without tracing are
     printed) and the HTML report of the plan (hetsynth.report_html) to `--out`, and print
     the report's path.
Exit status 1 when the losses differ by more than the tolerance.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from hetsynth.report import cluster_summary, cluster_summary_text, graph_summary_text, plan_summary_text
from hetsynth.instruction_set.cluster import ClusterSpec, load_cluster
from hetsynth.instruction_set.files import write_atomic
from hetsynth.instruction_set.plan import Plan, save_plan

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "bench" / "results" / "local-emulated-measured.toml"


def _section(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def demo_cluster(args: argparse.Namespace) -> tuple[ClusterSpec, str]:
    """The spec to plan for, and its file: measured when available."""
    base = Path(args.cluster)
    if args.profile:
        subprocess.run([sys.executable, "-m", "hetsynth", "profile", "--cluster", str(base), "-o", str(MEASURED)],
                       check=True)
    if base.resolve() == (ROOT / "configs" / "clusters" / "local-emulated.toml").resolve() and MEASURED.exists():
        return load_cluster(MEASURED), str(MEASURED.relative_to(ROOT))
    return load_cluster(base), str(base)


def make_plans(model: str, cluster: ClusterSpec) -> dict[str, Plan]:
    from hetsynth import capture_measured
    from hetsynth.planner import baselines
    from hetsynth.planner.capture import summarize
    from hetsynth.planner.planner import make_plan

    start = time.perf_counter()
    graph = capture_measured(model, cluster=cluster)
    print(f"captured {model} and timed it in {time.perf_counter() - start:.1f} s\n")
    print(graph_summary_text(summarize(graph)) + "\n")
    return {"hetsynth": make_plan(graph, cluster, progress=True),
            "DP-EV": make_plan(graph, cluster, ratios=baselines.even(cluster), restrictions=baselines.DP,
                               progress=False, with_baselines=False),
            "DP-CP": make_plan(graph, cluster, ratios=baselines.proportional(cluster), restrictions=baselines.DP,
                               progress=False, with_baselines=False)}


TRAINED = ("hetsynth", "DP-EV")  # DP-CP's plan only gives DDP-CP its rows


def compare(cluster: ClusterSpec, plans: dict[str, Plan], workdir: Path, args: argparse.Namespace,
            raw: Path) -> dict:
    from hetsynth.runtime.launch import launch_checked
    from hetsynth.runtime.plan_handoff import plan_digests

    paths = {}
    for name, plan in plans.items():
        paths[name] = str(workdir / f"{name}.json")
        save_plan(plan, paths[name])
    report = workdir / "compare.json"
    launch_checked(cluster, ["-m", "hetsynth.runtime.compare", "--plans", *(paths[n] for n in TRAINED), "--names", *TRAINED,
                             "--ddp", f"DDP-EV=mean:{paths['DP-EV']}", f"DDP-CP=weighted:{paths['DP-CP']}",
                             "--warmup", str(args.warmup), "--rounds", str(args.rounds),
                             "--steps", "2", "--report", str(report), "--traced", "hetsynth",
                             "--trace-raw", str(raw)], "the demo run", plans=plan_digests(list(paths.values())))
    return json.loads(report.read_text())


def parity(model: str, measured: dict, tolerance: float) -> bool:
    """Every plan's global loss per step against single-device training."""
    from hetsynth.instruction_set.models import parse_model_ref
    from hetsynth.runtime.config import TrainConfig
    from hetsynth.runtime.train import reference_training

    steps = max(len(m["losses"]) for name, m in measured.items() if name != "traced")
    spec = parse_model_ref(model)
    expected, _ = reference_training(spec, spec.batch_size, TrainConfig(steps=steps))
    ok = True
    for name, m in measured.items():
        if name == "traced":
            continue
        err = max(abs(g - w) / abs(w) for g, w in zip(m["losses"], expected))
        ok &= err <= tolerance
        print(f"{name:9s} {len(m['losses'])} steps: largest relative loss difference {err:.2e} "
              f"({'ok' if err <= tolerance else 'FAILED'}, tolerance {tolerance:g}); "
              f"last loss {m['losses'][-1]:.4f} vs {expected[len(m['losses']) - 1]:.4f}")
    return ok


def run_demo(args: argparse.Namespace) -> int:
    from hetsynth.runtime import emulation

    outputs = demo_outputs(args.out, args)
    cluster, source = demo_cluster(args)
    _section(f"cluster ({source})")
    print(cluster_summary_text(cluster_summary(cluster)))
    reason = emulation.unavailable()
    print("emulated on this machine: one network namespace per node, shaped links, CPU quotas" if reason is None
          else f"not emulated ({reason}): plain local processes, correctness only, timings say nothing")
    _section(f"plan {args.model}")
    plans = make_plans(args.model, cluster)
    print(plan_summary_text(plans["hetsynth"]))
    _section("run: hetsynth's plan, DP-EV, torch DDP-EV and DDP-CP, interleaved on the same workers")
    from hetsynth.runtime.launch import recorded_run

    with recorded_run() as (_, tmp):  # removed by the next command even if the demo is killed
        raw = tmp / "trace"
        raw.mkdir(mode=0o777)
        measured = compare(cluster, plans, tmp, args, raw)
        het = measured["hetsynth"]["median_s"]
        print(f"median step: hetsynth {het:.3f} s (predicted {plans['hetsynth'].predicted.step_time_s:.3f} s), "
              f"DP-EV {measured['DP-EV']['median_s']:.3f} s (predicted {plans['DP-EV'].predicted.step_time_s:.3f} s), "
              f"torch DDP-EV {measured['DDP-EV']['median_s']:.3f} s, DDP-CP {measured['DDP-CP']['median_s']:.3f} s")
        for name in ("DDP-EV", "DDP-CP", "DP-EV"):
            print(f"measured speed-up over {name}: {measured[name]['median_s'] / het:.2f}x")
        print(f"(one run: medians of {args.rounds} interleaved rounds; runs differ, so the median and range of "
              f"three independent runs are in bench/README.md, `python bench/measured_speedup.py`)")
        traced = measured["traced"]["median_s"]
        print(f"hetsynth traced (every instruction timed): median step {traced:.3f} s, {traced / het:.3f}x untraced")
        _section("parity with single-device training")
        ok = parity(args.model, measured, args.tolerance)
        _section("report")
        write_outputs(plans["hetsynth"], raw, outputs)
    return 0 if ok else 1


def demo_outputs(out: str, args: argparse.Namespace) -> dict[str, Path]:
    """The files the demo writes into `out` (created), checked before any work (none may be
    the cluster spec or the model file it reads)."""
    from hetsynth.runtime.outputs import check_outputs, model_file

    Path(out).mkdir(parents=True, exist_ok=True)
    names = {"plan": "plan.json", "predicted": "predicted.json", "measured": "measured.json",
             "comparison": "measured.instructions.json", "report": "report.html"}
    return check_outputs({f"--out ({k})": Path(out) / v for k, v in names.items()},
                         inputs={"--cluster": args.cluster, "--model": model_file(args.model)})


def write_outputs(plan: Plan, raw: Path, outputs: dict[str, Path]) -> None:
    """The plan, its traces and its report; prints what was written, the report last."""
    from hetsynth.measured import comparison, measured_trace, read_raw
    from hetsynth.report_html import report_html
    from hetsynth.trace import predicted_trace

    path = lambda key: outputs[f"--out ({key})"]
    save_plan(plan, path("plan"))
    write_atomic(path("predicted"), json.dumps(predicted_trace(plan)))
    trace = measured_trace(plan, read_raw(raw, plan.cluster.num_devices))
    write_atomic(path("measured"), json.dumps(trace))
    result = comparison(plan, trace)
    write_atomic(path("comparison"), json.dumps(result, indent=1))
    write_atomic(path("report"), report_html(plan, trace, result))
    print(f"wrote {path('plan')}, {path('predicted').name} and {path('measured').name} (Chrome traces: Perfetto, "
          f"chrome://tracing), {path('comparison').name}")
    print(f"report: {path('report')}")
