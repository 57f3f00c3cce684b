"""Predicted step time of hetsynth's plan against the baselines, for every zoo model on every
shipped cluster, under the same cost model.

    python bench/plan_quality.py [--clusters ...] [--models ...] [--out NAME]

GPU clusters use the `paper` presets with a global batch of 32 per device (the HAP setting);
local-emulated (4 CPU workers) uses the `small-cpu` presets at their own batch size. Prints a
table of step times (ms) and hetsynth's speed-up over each baseline, writes
bench/results/plan_quality.json (or bench/results/NAME with --out, for a partial run compared
against it).
"""

from __future__ import annotations

import argparse

from common import print_tables, run_child, write_json

CHILD = """
import json
import hetsynth
plan = hetsynth.plan({ref!r}, cluster="configs/clusters/{cluster}.toml", stages=1)  # SPMD against its baselines
print(json.dumps({{"hetsynth_s": plan.predicted.step_time_s, "fits": plan.predicted.fits,
                  "synthesis_s": plan.synthesis.seconds,
                  "baselines": {{k: {{"step_time_s": v.step_time_s, "fits": v.fits}}
                                for k, v in plan.baselines.items()}},
                  "ratios": plan.sharding_ratios}}))
"""

CLUSTERS = {"hap-paper": 64, "a100-t4": 8, "a100x8": 8, "local-emulated": 4}
MODELS = ["gpt", "bert", "vit", "vgg", "moe"]


def model_ref(model: str, cluster: str) -> str:
    if cluster == "local-emulated":
        return f"{model}:small-cpu"
    return f"{model}:paper,batch_size={32 * CLUSTERS[cluster]}"


def row(model: str, cluster: str, r: dict) -> list:
    if "error" in r:
        return [model, cluster, "error: " + r["error"][:60], "", "", "", "", ""]
    b = {k: v["step_time_s"] for k, v in r["baselines"].items()}
    best = min(b.values())
    ms = lambda s: f"{s * 1e3:.1f}"
    return [model, cluster, ms(r["hetsynth_s"]), ms(b["dp_ev"]), ms(b["dp_cp"]), ms(b["megatron"]),
            f"{best / r['hetsynth_s']:.2f}x", f"{r['synthesis_s']:.1f}"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clusters", nargs="+", default=list(CLUSTERS))
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--out", default="plan_quality.json", help="file name under bench/results/")
    args = parser.parse_args()
    results, rows = {}, []
    for cluster in args.clusters:
        for model in args.models:
            r = run_child(CHILD.format(ref=model_ref(model, cluster), cluster=cluster), timeout_s=3600)
            results[f"{model}/{cluster}"] = {"model": model_ref(model, cluster), "cluster": cluster, **r}
            rows.append(row(model, cluster, r))
            print(rows[-1], flush=True)
    header = ["model", "cluster", "hetsynth ms", "DP-EV ms", "DP-CP ms", "Megatron ms",
              "vs best baseline", "synthesis s"]
    print_tables(rows, header)
    write_json(args.out, results)


if __name__ == "__main__":
    main()
