"""Synthesis time of hetsynth's planner: ViT with 1 to 64 layers on 8 and 64 devices, and
GPT (paper preset) on 64 to 4,096 devices.

    python bench/synthesis_time.py [--devices 8 64] [--layers 1 4 12 24 48 64]
                                   [--scale 64 256 1024 4096] [--skip-layers | --skip-scale]

Depth: the first N devices of configs/clusters/hap-paper.toml (8: one V100 node, one-level
layouts; 64: the whole cluster, a 8 x 8 mesh with two-level layouts). Model: vit:paper with
the given number of layers, batch 8 per device.

Scale: hap-paper's nodes scaled to N / 8 nodes of 8 GPUs in its proportions (a quarter V100
nodes, the rest P100, ClusterSpec.scaled; made here, not shipped), gpt:paper with a global
batch of 32 per device; also reports the number of classes of interchangeable devices the
planner works on (cost_models.device_classes).

Each point runs in a fresh process and measures the synthesis (A* search with its
incumbents, LP, alternation rounds; baselines excluded) and the process's peak RSS. Prints
tables, writes bench/results/synthesis_time.json. For reference, HAP's own search on such a
machine (EuroSys'24 artifact, ViT, 8 devices): 12 layers 1.5-2.4 s, 24 layers 7-10 s, 48
layers 28-54 s, 64 layers 67-115 s.
"""

from __future__ import annotations

import argparse

from common import markdown_table, print_table, run_child, write_json

PREAMBLE = """
import json, resource, time
from hetsynth import capture_model
from instruction_set.cluster import load_cluster
from planner.planner import search_plan
"""

SEARCH = """
start = time.perf_counter()
best, stats = search_plan(graph, cluster, progress=False)
seconds = time.perf_counter() - start
from planner.problem import Problem
print(json.dumps({{"seconds": seconds, "search_seconds": stats.search_s, "lp_seconds": stats.lp_s,
                  "states_expanded": stats.expanded, "rounds": stats.rounds, "exact": stats.exact,
                  "ops": len(graph.calls), "predicted_step_s": best.prediction.step_time_s,
                  "device_classes": Problem(graph, cluster, best.ratios).width,
                  "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}}))
"""

DEPTH = PREAMBLE + """
cluster = load_cluster("configs/clusters/hap-paper.toml").first({devices})
graph = capture_model("vit:paper,num_layers={layers},batch_size={batch}")
""" + SEARCH

SCALE = PREAMBLE + """
cluster = load_cluster("configs/clusters/hap-paper.toml").scaled({devices} // 8)
graph = capture_model("gpt:paper,batch_size={batch}")
""" + SEARCH


def depth(devices_list: list[int], layers_list: list[int], results: dict) -> None:
    rows = []
    for devices in devices_list:
        for layers in layers_list:
            r = run_child(DEPTH.format(devices=devices, layers=layers, batch=8 * devices))
            results[f"{devices}/{layers}"] = {"devices": devices, "layers": layers, **r}
            if "error" in r:
                rows.append([devices, layers, "error", r["error"], "", "", ""])
            else:
                rows.append([devices, layers, r["ops"], f"{r['seconds']:.2f}", f"{r['states_expanded']:,}",
                             r["rounds"], f"{r['peak_rss_gib']:.2f}"])
            print(rows[-1], flush=True)
    header = ["devices", "layers", "ops", "synthesis s", "states expanded", "rounds", "peak GiB"]
    print()
    print_table(rows, header)
    for devices in devices_list:
        a, b = results.get(f"{devices}/12"), results.get(f"{devices}/64")
        if a and b and "seconds" in a and "seconds" in b:
            print(f"{devices} devices: 64 layers / 12 layers = {b['seconds'] / a['seconds']:.2f}x")
    print("\n" + markdown_table(rows, header))


def scale(devices_list: list[int], results: dict) -> None:
    rows = []
    for devices in devices_list:
        r = run_child(SCALE.format(devices=devices, batch=32 * devices))
        results[f"gpt-scale/{devices}"] = {"devices": devices, "model": "gpt:paper", **r}
        if "error" in r:
            rows.append([devices, devices // 8, "error", r["error"], "", "", "", ""])
        else:
            rows.append([devices, devices // 8, r["device_classes"], f"{r['seconds']:.2f}",
                         f"{r['states_expanded']:,}", r["rounds"], f"{r['predicted_step_s'] * 1e3:.1f}",
                         f"{r['peak_rss_gib']:.2f}"])
        print(rows[-1], flush=True)
    header = ["devices", "nodes", "device classes", "synthesis s", "states expanded", "rounds",
              "predicted ms", "peak GiB"]
    print()
    print_table(rows, header)
    print("\n" + markdown_table(rows, header))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 4, 12, 24, 48, 64])
    parser.add_argument("--scale", type=int, nargs="+", default=[64, 256, 1024, 4096],
                        help="device counts for gpt:paper on hap-paper-like clusters (multiples of 8)")
    parser.add_argument("--skip-layers", action="store_true")
    parser.add_argument("--skip-scale", action="store_true")
    args = parser.parse_args()
    results: dict = {}
    if not args.skip_layers:
        depth(args.devices, args.layers, results)
    if not args.skip_scale:
        scale(args.scale, results)
    write_json("synthesis_time.json", results)


if __name__ == "__main__":
    main()
