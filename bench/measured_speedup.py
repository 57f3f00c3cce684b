"""Measured speed-ups on the emulated heterogeneous cluster: hetsynth's plan vs torch DDP
(DDP-EV, DDP-CP) and our own data-parallel plans (DP-EV, DP-CP).

    python bench/measured_speedup.py [--models gpt bert vgg] [--runs 3] [--reprofile]

Cluster: configs/clusters/local-emulated.toml emulated on this machine (runtime.emulation):
two nodes, 2 workers at 0.5 CPU and 2 at 0.25 CPU, 200 Mbit/s between the nodes. It is
profiled first (`hetsynth profile`, cached in bench/results/local-emulated-measured.toml;
--reprofile measures again) and every plan is made for the measured spec, with the model's
ops timed on this machine (profiling.op_profile, `hetsynth plan --measure-ops`). For each model's
`small-cpu` preset, hetsynth's plan, DP-EV (even batch split) and DP-CP (split proportional
to measured throughput), and torch's own DistributedDataParallel on the plain model with the
same rows as DP-EV (DDP-EV: as users run it) and as DP-CP with the loss weights that make
uneven rows train the global batch (DDP-CP, runtime.ddp), train on the same workers,
interleaved (runtime.compare: warm-up, then rounds of a few steps of each in turn); the table
gives the median step time of each, hetsynth's speed-ups against torch DDP and against the
best of the four baselines, and its predicted step time next to the measured one. `--runs N`
(default 3) repeats all of it, planning included, N times: the table gives each time's
median over the runs and each ratio's median and range. Writes
bench/results/measured_speedup.json as {"runs": [{model: {hetsynth_s, ddp_ev_s, ..., the
run's detail}}, ...], "models": {model: {the medians over the runs, best_baseline,
"ratios": {vs_ddp_ev, vs_ddp_cp, vs_best_baseline, prediction_error: {median, min, max}}}}}. Needs root for the emulation; without it the processes run unshaped
and the numbers say nothing about heterogeneity.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from common import ROOT, print_tables, profiled, write_json
from make_readme import ranged  # the README's own form of a ratio's median and range

sys.path.insert(0, str(ROOT))

CLUSTER = ROOT / "configs" / "clusters" / "local-emulated.toml"


def plans(ref: str, cluster_path: Path, workdir: Path) -> dict[str, tuple[str, float]]:
    """name -> (plan file, predicted step seconds, sync_summary) for hetsynth, DP-EV and DP-CP."""
    import hetsynth
    from hetsynth.planner import baselines
    from hetsynth.planner.planner import make_plan

    cluster = hetsynth.load_cluster(str(cluster_path))
    graph = hetsynth.capture_measured(ref, cluster=cluster)
    made = {
        "hetsynth": make_plan(graph, cluster, progress=False, with_baselines=False),
        "dp_ev": make_plan(graph, cluster, ratios=baselines.even(cluster), restrictions=baselines.DP,
                           progress=False, with_baselines=False),
        "dp_cp": make_plan(graph, cluster, ratios=baselines.proportional(cluster), restrictions=baselines.DP,
                           progress=False, with_baselines=False),
    }
    out = {}
    for name, plan in made.items():
        path = workdir / f"{name}.json"
        hetsynth.save_plan(plan, path)
        out[name] = (str(path), plan.predicted.step_time_s, sync_summary(plan))
    return out


def sync_summary(plan) -> dict:
    """The gradient buckets the cost model chose, and what it predicted for each candidate."""
    g = plan.gradient_sync
    if g is None:
        return {}
    return {"buckets": len(g.buckets), "variants": sorted({b.variant for b in g.buckets}),
            "cap_bytes": g.bucket_cap_bytes, "first_cap_bytes": g.first_bucket_cap_bytes,
            "chosen_from": g.chosen_from}


def measure(cluster_path: Path, made: dict, workdir: Path, rounds: int, steps: int) -> dict:
    from hetsynth.instruction_set.cluster import load_cluster
    from hetsynth.runtime.launch import launch_checked

    report = workdir / "compare.json"
    names = list(made)
    ddp = [f"ddp_ev=mean:{made['dp_ev'][0]}", f"ddp_cp=weighted:{made['dp_cp'][0]}"]
    launch_checked(load_cluster(cluster_path),
                   ["-m", "hetsynth.runtime.compare", "--plans", *[made[n][0] for n in names], "--names", *names,
                    "--ddp", *ddp, "--warmup", "2", "--rounds", str(rounds), "--steps", str(steps),
                    "--report", str(report)], "measurement")
    return json.loads(report.read_text())


BASELINES = {"ddp_ev": "DDP-EV", "ddp_cp": "DDP-CP", "dp_ev": "DP-EV", "dp_cp": "DP-CP"}


def result(times: dict, made: dict) -> dict:
    r = {f"{n}_s": times[n]["median_s"] for n in ("hetsynth", *BASELINES)}
    best = min(BASELINES, key=lambda n: r[f"{n}_s"])
    r |= {"best_baseline": BASELINES[best], "predicted_s": made["hetsynth"][1],
          "predicted_dp_ev_s": made["dp_ev"][1], "predicted_dp_cp_s": made["dp_cp"][1],
          "gradient_sync": {n: m[2] for n, m in made.items()},
          "wire_bytes_per_step": {n: t["wire_bytes_per_step"] for n, t in times.items()},
          "step_seconds": {n: t["step_seconds"] for n, t in times.items()},
          "phases_by_rank": {n: t["phases_by_rank"] for n, t in times.items()}}
    return r


# each ratio of one run's result (baseline / hetsynth: above 1 favours hetsynth)
RATIOS = {
    "vs_ddp_ev": lambda r: r["ddp_ev_s"] / r["hetsynth_s"],
    "vs_ddp_cp": lambda r: r["ddp_cp_s"] / r["hetsynth_s"],
    "vs_best_baseline": lambda r: min(r[f"{n}_s"] for n in BASELINES) / r["hetsynth_s"],
    "prediction_error": lambda r: r["predicted_s"] / r["hetsynth_s"] - 1,
}
MEDIANS = ("hetsynth_s", "ddp_ev_s", "ddp_cp_s", "dp_ev_s", "dp_cp_s", "predicted_s", "predicted_dp_ev_s",
           "predicted_dp_cp_s")


def summary(results: list[dict]) -> dict:
    """One model over the runs: each time's median, the baseline fastest by median, and each
    ratio's median and range (over the runs' own ratios)."""
    med = {k: statistics.median(r[k] for r in results) for k in MEDIANS}
    best = min(BASELINES, key=lambda n: med[f"{n}_s"])
    ratios = {name: [f(r) for r in results] for name, f in RATIOS.items()}
    return med | {"best_baseline": BASELINES[best], "runs": len(results),
                  "ratios": {name: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                             for name, v in ratios.items()}}


def row(model: str, r: dict) -> list[str]:
    q = r["ratios"]
    x, pct = (lambda v: f"{v:.2f}"), (lambda v: f"{v:+.0%}")
    return [model, f"{r['hetsynth_s']:.3f}", *(f"{r[f'{n}_s']:.3f}" for n in BASELINES),
            ranged(q["vs_ddp_ev"], x), ranged(q["vs_ddp_cp"], x),
            f"{ranged(q['vs_best_baseline'], x)} ({r['best_baseline']})", f"{r['predicted_s']:.3f}",
            ranged(q["prediction_error"], pct)]


def one_run(models: list[str], spec: Path, rounds: int, steps: int) -> dict[str, dict]:
    """Every model planned and measured once: model -> result()."""
    results = {}
    for model in models:
        with tempfile.TemporaryDirectory() as tmp:
            made = plans(f"{model}:small-cpu", spec, Path(tmp))
            times = measure(spec, made, Path(tmp), rounds, steps)
        results[model] = r = result(times, made)
        print(f"  {model}: hetsynth {r['hetsynth_s']:.3f} s, best baseline / hetsynth "
              f"{RATIOS['vs_best_baseline'](r):.2f}x", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["gpt", "bert", "vgg"])
    parser.add_argument("--reprofile", action="store_true")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3, help="independent runs (planning included)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: give at least 1")
    measured_spec = profiled(CLUSTER, args.reprofile)
    runs = []
    for i in range(args.runs):
        print(f"run {i + 1}/{args.runs}", flush=True)
        runs.append(one_run(args.models, measured_spec, args.rounds, args.steps))
    models = {m: summary([run[m] for run in runs]) for m in args.models}
    header = ["model (small-cpu)", "hetsynth s", "DDP-EV s", "DDP-CP s", "DP-EV s", "DP-CP s", "vs DDP-EV",
              "vs DDP-CP", "vs best baseline", "predicted s", "prediction error"]
    print(f"medians of {args.runs} runs; ratios: median (min to max)")
    print_tables([row(m, r) for m, r in models.items()], header)
    write_json("measured_speedup.json", {"runs": runs, "models": models, "cluster": str(CLUSTER.relative_to(ROOT)),
                                         "measured_spec": str(measured_spec.relative_to(ROOT))})


if __name__ == "__main__":
    main()
