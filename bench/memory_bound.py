"""hetsynth's plan against torch FSDP2 where memory binds: configs/clusters/memory-bound-emulated.toml.

    python bench/memory_bound.py [--runs 3] [--warmup 1 --rounds 4] [--configs NAME ...]

The same model (MODEL), initialisation, data, optimizer (AdamW) and global-norm clipping in every
configuration (runtime.compare's entries):

  hetsynth            the plan `hetsynth plan --model MODEL --cluster <measured spec> --measure-ops`
                      makes (ZeRO rows, shards and rows sized by memory and speed)
  fsdp_even           torch FSDP2 (runtime.fsdp: fully_shard per block, even shards), even rows
  fsdp_even_ckpt      the same with activation checkpointing of every block
  fsdp_prop           FSDP2 with throughput-proportional rows and matching loss weights
  fsdp_prop_ckpt      the same with activation checkpointing
  ddp                 torch DDP, even rows (a whole replica per rank)
  ddp_cp              torch DDP, throughput-proportional rows and loss weights

As a user would, the cluster is profiled first (`hetsynth profile`, cached in
bench/results/memory-bound-emulated-measured.toml; --reprofile measures again) and the plans are
made for the measured spec with the model's ops timed here (the spec's own figures are nominal:
planned on them, hetsynth's plan took 2.24 s a step, 13% more than it predicted; planned on the
measured spec, 1.36-1.38 s, within 5% of its prediction).
The measured spec decides the rows of the proportional baselines too.

One launch per configuration, not one launch for all. Interleaving entries in one launch
(runtime.compare) keeps every entry's model and optimizer state resident at once, so the peak a
rank's memory group measures would be the sum of all of them, and one entry's OOM kill ends the
launch and loses every other entry. Each configuration therefore runs alone on a fresh
emulated cluster (warm-up, then `--rounds` timed steps), which is its own probe: a configuration
past a limit is reported by the launcher as out of memory with the rank and the limit, and the
others still run. Machine conditions are spread evenly instead: every run goes through the
configurations in a rotated order (run k starts at configuration k), and `--runs` independent
runs are made.

Figures per run and configuration: median step seconds (rank 0's wall time of each timed step),
each rank's measured peak memory (its memory cgroup's max_usage_in_bytes; every configuration
builds the model whole on the host and places its part on the device, runtime.emulation.host_memory)
and limit, or the failure. For hetsynth also the plan's predicted step time and peak per device,
and the peak's error on the rank where it is largest ("peak_prediction_error"). Ratio per run: the fastest FSDP2
configuration that fit / hetsynth (above 1: hetsynth faster); the table gives its median and
range over the runs, and the same for DDP where it fit; a run where no FSDP2 configuration
fit has no "vs_fsdp_best" (the failures say which rank ran out of memory at which limit). On
the shipped cluster every FSDP2 variant fits and DDP does not (the spec's comment has the
peaks); `--cluster` takes another spec. Writes bench/results/memory_bound.json as
{"model", "cluster", "runs": [{config: {...}}], "summary": {config: {...}}, "ratios": {"vs_fsdp_best":
{"median", "min", "max"}, ...}}. Needs root and the cgroup v1 memory controller (without them the
ranks run unlimited and unshaped: the figures would mean nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from common import ROOT, print_tables, profiled, write_json

sys.path.insert(0, str(ROOT))

CLUSTER = ROOT / "configs" / "clusters" / "memory-bound-emulated.toml"
MODEL = ("gpt:small-cpu,vocab_size=2048,seq_len=32,num_layers=4,hidden=512,num_heads=8,ffn_hidden=2048,"
         "batch_size=16")  # 13.6 M parameters: a replica's state (16 bytes each with AdamW) is 208 MiB
FSDP = {"fsdp_even": "even", "fsdp_even_ckpt": "even-ckpt", "fsdp_prop": "proportional",
        "fsdp_prop_ckpt": "proportional-ckpt"}
CONFIGS = ("hetsynth", *FSDP, "ddp", "ddp_cp")
MIB = 2**20


def make_plans(model: str, cluster_path: Path, workdir: Path) -> dict[str, Path]:
    """hetsynth's plan and the data-parallel plans whose rows the DDP entries take (even, proportional)."""
    import hetsynth
    from hetsynth.planner import baselines
    from hetsynth.planner.planner import make_plan

    cluster = hetsynth.load_cluster(str(cluster_path))
    graph = hetsynth.capture_measured(model, cluster=cluster)
    plans = {"hetsynth": make_plan(graph, cluster, progress=False, with_baselines=False),
             "ev": make_plan(graph, cluster, ratios=baselines.even(cluster), restrictions=baselines.DP,
                             progress=False, with_baselines=False),
             "cp": make_plan(graph, cluster, ratios=baselines.proportional(cluster), restrictions=baselines.DP,
                             progress=False, with_baselines=False)}
    paths = {name: workdir / f"{name}.json" for name in plans}
    for name, plan in plans.items():
        hetsynth.save_plan(plan, paths[name])
    return paths


def entry_args(config: str, plans: dict[str, Path]) -> list[str]:
    """hetsynth.runtime.compare's arguments for one configuration alone."""
    if config == "hetsynth":
        return ["--plans", str(plans["hetsynth"]), "--names", config]
    if config in FSDP:
        return ["--fsdp", f"{config}={FSDP[config]}:{plans['hetsynth']}"]
    mode, plan = ("mean", plans["ev"]) if config == "ddp" else ("weighted", plans["cp"])
    return ["--ddp", f"{config}={mode}:{plan}"]


def run_config(config: str, cluster_path: Path, plans: dict[str, Path], workdir: Path, warmup: int,
               rounds: int) -> dict:
    """One launch of one configuration: its median step, peaks and limits per rank, or its failure."""
    import hetsynth
    from hetsynth.runtime.launch import MEMORY_FILE, launch_in, recorded_run

    report = workdir / f"{config}-report.json"
    cluster = hetsynth.load_cluster(str(cluster_path))
    args = ["-m", "hetsynth.runtime.compare", *entry_args(config, plans), "--warmup", str(warmup), "--rounds", str(rounds),
            "--steps", "1", "--report", str(report)]
    with recorded_run() as (record, launch_dir):
        rc, failure = launch_in(record, launch_dir, cluster, args, timeout_s=120)
        memory = launch_dir / MEMORY_FILE
        usage = json.loads(memory.read_text()) if memory.exists() else {}
    out: dict = {"ok": rc == 0, "failure": None if rc == 0 else str(failure or f"exit status {rc}"),
                 "peak_mib_by_rank": [round(usage[r]["peak_bytes"] / MIB, 1) for r in sorted(usage, key=int)],
                 "limit_mib_by_rank": [round(usage[r]["limit_bytes"] / MIB, 1) for r in sorted(usage, key=int)],
                 "out_of_memory_ranks": [int(r) for r in sorted(usage, key=int) if usage[r]["oom_kills"]]}
    if rc == 0:
        times = json.loads(report.read_text())[config]
        out |= {"median_s": times["median_s"], "step_seconds": times["step_seconds"], "losses": times["losses"]}
    return out


def predicted(plan_path: Path) -> dict:
    """hetsynth's predicted step and peak per device (MiB)."""
    from hetsynth.instruction_set.plan import load_plan

    plan = load_plan(str(plan_path))
    return {"step_s": plan.predicted.step_time_s,
            "peak_mib_by_rank": [round(d.memory_gib * 1024, 1) for d in plan.predicted.devices]}


def one_run(index: int, configs: list[str], cluster_path: Path, spec_path: Path, model: str, warmup: int,
            rounds: int) -> dict:
    """Every configuration once, starting at configuration `index` (rotated order); the plans are
    made for `spec_path` (the cluster's measured spec) and run on `cluster_path`."""
    order = configs[index % len(configs):] + configs[:index % len(configs)]
    with tempfile.TemporaryDirectory(prefix="hetsynth-bench-") as tmp:
        plans = make_plans(model, spec_path, Path(tmp))
        results = {c: run_config(c, cluster_path, plans, Path(tmp), warmup, rounds) for c in order}
        if "hetsynth" in results:
            results["hetsynth"]["predicted"] = predicted(plans["hetsynth"])
    return {c: results[c] for c in configs}


def ratios(run: dict) -> dict[str, float]:
    """This run's speed-ups of hetsynth: the fastest FSDP2 that fit / hetsynth, DDP (either) likewise."""
    het = run.get("hetsynth", {})
    if not het.get("ok"):
        return {}
    out = {}
    for name, family in (("vs_fsdp_best", FSDP), ("vs_ddp_best", ("ddp", "ddp_cp"))):
        fit = [run[c]["median_s"] for c in family if c in run and run[c]["ok"]]
        if fit:
            out[name] = min(fit) / het["median_s"]
    out["prediction_error"] = (het["predicted"]["step_s"] - het["median_s"]) / het["median_s"]
    peak_errors = [(p - m) / m for p, m in zip(het["predicted"]["peak_mib_by_rank"], het["peak_mib_by_rank"])]
    if peak_errors:
        out["peak_prediction_error"] = max(peak_errors, key=abs)
    return out


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: list[dict], configs: list[str]) -> tuple[dict, dict]:
    """Per configuration: how many runs it fit, its median step and largest peak per rank; per
    ratio: median and range over the runs."""
    summary = {}
    for c in configs:
        ok = [r[c] for r in runs if r[c]["ok"]]
        summary[c] = {"fit_runs": len(ok), "runs": len(runs),
                      "median_s": statistics.median(r["median_s"] for r in ok) if ok else None,
                      "peak_mib_by_rank": [max(p) for p in zip(*(r[c]["peak_mib_by_rank"] for r in runs))]
                      if all(r[c]["peak_mib_by_rank"] for r in runs) else [],
                      "failures": sorted({r[c]["failure"] for r in runs if not r[c]["ok"]})}
    per_run = [ratios(r) for r in runs]
    names = sorted({k for r in per_run for k in r})
    return summary, {k: spread([r[k] for r in per_run if k in r]) for k in names}


def table_rows(index: int, run: dict) -> list[list]:
    rows = []
    for c, r in run.items():
        pred = r.get("predicted")
        rows.append([index + 1, c, f"{r['median_s']:.3f}" if r["ok"] else "-",
                     f"{pred['step_s']:.3f}" if pred else "",
                     " ".join(f"{p:.0f}" for p in r["peak_mib_by_rank"]),
                     " ".join(f"{p:.0f}" for p in pred["peak_mib_by_rank"]) if pred else "",
                     " ".join(f"{p:.0f}" for p in r["limit_mib_by_rank"]),
                     "fits" if r["ok"] else (r["failure"] or "")[:110]])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--cluster", type=Path, default=CLUSTER)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4, help="timed steps per configuration and run")
    parser.add_argument("--runs", type=int, default=3, help="independent runs (median and range of each ratio)")
    parser.add_argument("--out", default="memory_bound.json", help="file name under bench/results/")
    parser.add_argument("--reprofile", action="store_true", help="measure the cluster again (else the cached spec)")
    args = parser.parse_args()
    spec = profiled(args.cluster, args.reprofile)
    runs, rows = [], []
    for i in range(args.runs):
        runs.append(one_run(i, args.configs, args.cluster, spec, args.model, args.warmup, args.rounds))
        rows += table_rows(i, runs[-1])
        print(json.dumps({c: {k: v for k, v in r.items() if k not in ("losses", "step_seconds")}
                          for c, r in runs[-1].items()}), flush=True)
    print_tables(rows, ["run", "configuration", "median step s", "predicted s", "peak MiB per rank",
                        "predicted peak MiB", "limit MiB", "result"])
    summary, spreads = summarize(runs, args.configs)
    print_tables([[k, f"{v['median']:.3f}", f"{v['min']:.3f}-{v['max']:.3f}"] for k, v in spreads.items()],
                 ["ratio (fastest that fit / hetsynth; prediction (pred - meas) / meas)", f"median of {args.runs}",
                  "range"])
    write_json(args.out, {"model": args.model, "cluster": str(args.cluster), "measured_spec": str(spec),
                          "warmup": args.warmup,
                          "rounds": args.rounds, "runs": runs, "summary": summary, "ratios": spreads})


if __name__ == "__main__":
    main()
