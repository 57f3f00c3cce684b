"""hetsynth's data-parallel plan against torch's DistributedDataParallel on equal ranks.

    python bench/ddp_overhead.py [--model gpt:small-cpu] [--envs local emulated] [--rounds 8 --steps 2]
                                 [--runs 3]

Both train the same model from the same initialisation on the same rows (an even split of the
global batch), with the same optimizer (AdamW) and global-norm clipping, interleaved in one
launch (runtime.compare: warm-up, then rounds of a few steps of each in turn; a barrier before
each round's timed steps). Environments:

  local     two plain processes on this machine (one node, loopback, no quotas, one torch
            thread each)
  emulated  an equal-quota copy of configs/clusters/local-emulated.toml: two emulated nodes of
            two workers at 0.25 CPU each (cgroup quotas), 200 Mbit/s between the nodes; the
            quarter-CPU kind's measured cost of transfers in flight comes from
            bench/results/local-emulated-measured.toml (`hetsynth profile`) when it is there

hetsynth's plan is the data-parallel program (planner.baselines.DP) at even ratios, exactly
what `hetsynth plan --data-parallel` makes for equal devices, with the bucket cap the cost
model chooses; beside it, interleaved in the same launch, the same program with one gradient
bucket ("one bucket": its all-reduce can only start once the whole backward is done, so
nothing overlaps; its `gradient_sync` phase is the unhidden sync); and the same plan's module,
what `hetsynth.parallelize` returns, trained by a user's loop (runtime.compare --user: torch's
AdamW on its parameters, backward, clip_grad_norm_, step, zero_grad, global_loss) against
`hetsynth run`'s own step on it ("parallelize / run": the acceptance figure, <= 1.03). Each of
`--runs` independent launches gives one median per entry; the table gives each run's median
step seconds and ratios, then the median and range of each ratio over the runs, and the
median seconds of each phase on rank 0. Writes bench/results/ddp_overhead.json as {"runs":
[{env: {"hetsynth_s", "ddp_s", "one_bucket_s", "parallelize_s", "ratio",
"parallelize_ratio", "phases": {name: {phase: s}}, "phases_by_rank": ..., "step_seconds":
...}}], "summary": {env: {ratio name: {"median", "min", "max"}}}}.
The emulated part needs root (without it the processes run unshaped).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from common import ROOT, print_tables, write_json

sys.path.insert(0, str(ROOT))

EMULATED = ROOT / "configs" / "clusters" / "local-emulated.toml"
MEASURED = ROOT / "bench" / "results" / "local-emulated-measured.toml"  # bench/measured_speedup.py's profile

LOCAL_SPEC = """name = "local-equal"
description = "two plain processes on this machine"
[device_kinds.cpu]
throughput_flops = 20e9
memory_gib = 4
[[nodes]]
name = "local"
kind = "cpu"
num_devices = 2
[links]
intra_node_bandwidth_gbps = 8
intra_node_latency_us = 50
inter_node_bandwidth_gbps = 8
inter_node_latency_us = 50
"""


def equal_quota_copy(source: Path, measured: Path | None = None) -> str:
    """The spec at `source` with every worker of the slowest quota's kind: equal ranks on the
    same nodes and links (TOML); with `measured` (the profiled spec of the same cluster), that
    kind's measured cost of transfers in flight (transfer_cpu_*), which the bucket choice uses."""
    import tomllib

    from hetsynth.instruction_set.cluster import cluster_from_dict, dump_cluster_toml

    raw = tomllib.loads(source.read_text())
    quotas = raw["emulation"]["cpu_quota"]
    slow = min(quotas, key=quotas.get)
    raw["name"], raw["description"] = f"{raw['name']}-equal", f"every worker at {quotas[slow]} CPU"
    raw["device_kinds"] = {slow: raw["device_kinds"][slow]}
    if measured is not None and measured.exists():
        kind = tomllib.loads(measured.read_text())["device_kinds"][slow]
        raw["device_kinds"][slow] |= {k: v for k, v in kind.items() if k.startswith("transfer_cpu_")}
    raw["emulation"]["cpu_quota"] = {slow: quotas[slow]}
    for node in raw["nodes"]:
        node["kind"] = slow
    return dump_cluster_toml(cluster_from_dict(raw, str(source)))


def run_env(env: str, model: str, workdir: Path, rounds: int, steps: int) -> dict:
    import hetsynth
    from hetsynth.planner import baselines
    from hetsynth.planner.planner import make_plan
    from hetsynth.planner.step_cost import ONE_BUCKET
    from hetsynth.runtime.launch import launch_checked

    spec_path = workdir / f"{env}.toml"
    spec_path.write_text(LOCAL_SPEC if env == "local" else equal_quota_copy(EMULATED, MEASURED))
    cluster = hetsynth.load_cluster(str(spec_path))
    graph = hetsynth.capture_model(model)
    paths = {}
    for name, cap in (("hetsynth", None), ("one_bucket", ONE_BUCKET)):
        plan = make_plan(graph, cluster, ratios=baselines.even(cluster), restrictions=baselines.DP,
                         progress=False, with_baselines=False, bucket_cap=cap)
        paths[name] = workdir / f"{env}-{name}.json"
        hetsynth.save_plan(plan, paths[name])
    report = workdir / f"{env}-compare.json"
    launch_checked(cluster, ["-m", "hetsynth.runtime.compare", "--plans", *map(str, paths.values()), "--names", *paths,
                             "--ddp", f"ddp=mean:{paths['hetsynth']}", "--user", f"parallelize={paths['hetsynth']}",
                             "--warmup", "2", "--rounds", str(rounds),
                             "--steps", str(steps), "--report", str(report)], f"ddp_overhead ({env})")
    times = json.loads(report.read_text())
    names = (*paths, "parallelize", "ddp")
    return {"hetsynth_s": times["hetsynth"]["median_s"], "ddp_s": times["ddp"]["median_s"],
            "one_bucket_s": times["one_bucket"]["median_s"], "parallelize_s": times["parallelize"]["median_s"],
            "ratio": times["hetsynth"]["median_s"] / times["ddp"]["median_s"],
            "parallelize_ratio": times["parallelize"]["median_s"] / times["hetsynth"]["median_s"],
            "phases": {n: times[n]["phases_by_rank"][0] for n in names},
            "phases_by_rank": {n: times[n]["phases_by_rank"] for n in names},
            "step_seconds": {n: times[n]["step_seconds"] for n in names},
            "losses": {n: times[n]["losses"] for n in names},
            "devices": cluster.num_devices}


def phase_text(phases: dict[str, float]) -> str:
    """The phases in ms (the buckets' launch and completion times stay in the JSON)."""
    return " ".join(f"{k} {v * 1e3:.1f}" for k, v in phases.items() if k != "data" and not k.startswith("bucket"))


RATIOS = {"ratio": "hetsynth / DDP", "parallelize_ratio": "parallelize / run"}


def summary(runs: list[dict]) -> dict:
    """Per environment and ratio, the median and range over the runs."""
    return {env: {name: {"median": statistics.median(r[env][name] for r in runs),
                         "min": min(r[env][name] for r in runs), "max": max(r[env][name] for r in runs)}
                  for name in RATIOS} for env in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt:small-cpu")
    parser.add_argument("--envs", nargs="+", default=["local", "emulated"], choices=["local", "emulated"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3, help="independent launches (median and range of each ratio)")
    args = parser.parse_args()
    runs: list[dict] = []
    rows = []
    for run in range(args.runs):
        results = {}
        for env in args.envs:
            with tempfile.TemporaryDirectory() as tmp:
                r = results[env] = run_env(env, args.model, Path(tmp), args.rounds, args.steps)
            rows.append([run + 1, env, r["devices"], f"{r['hetsynth_s']:.4f}", f"{r['ddp_s']:.4f}", f"{r['ratio']:.3f}x",
                         f"{r['parallelize_s']:.4f}", f"{r['parallelize_ratio']:.3f}x", f"{r['one_bucket_s']:.4f}",
                         phase_text(r["phases"]["hetsynth"]), phase_text(r["phases"]["ddp"])])
            print(rows[-1], flush=True)
        runs.append(results)
    header = ["run", "environment", "ranks", "hetsynth run s", "torch DDP s", "hetsynth / DDP", "parallelize s",
              "parallelize / run", "one bucket s", "hetsynth phases ms (rank 0)", "DDP phases ms (rank 0)"]
    print_tables(rows, header)
    totals = summary(runs)
    print_tables([[env, label, f"{v[name]['median']:.3f}x", f"{v[name]['min']:.3f}-{v[name]['max']:.3f}x"]
                  for env, v in totals.items() for name, label in RATIOS.items()],
                 ["environment", "ratio", f"median of {args.runs}", "range"])
    write_json("ddp_overhead.json", {"model": args.model, "rounds": args.rounds, "steps": args.steps,
                                     "runs": runs, "summary": totals})


if __name__ == "__main__":
    main()
