"""Synthesis time of hetsynth's planner: ViT with 1 to 64 layers on 8 and 64 devices, and
GPT (paper preset) on 64 to 4,096 devices, and planning with pipeline stages considered (GPT,
6 to 48 layers, 64 devices).

    python bench/synthesis_time.py [--devices 8 64] [--layers 1 4 12 24 48 64]
                                   [--scale 64 256 1024 4096] [--pipeline 6 12 24 48]
                                   [--shapes llama3-8b llama-70b] [--shape-devices 64 1024]
                                   [--skip-layers] [--skip-scale] [--skip-pipeline] [--skip-shapes]

Depth: the first N devices of configs/clusters/hap-paper.toml (8: one V100 node, one-level
layouts; 64: the whole cluster, a 8 x 8 mesh with two-level layouts). Model: vit:paper with
the given number of layers, batch 8 per device.

Scale: hap-paper's nodes scaled to N / 8 nodes of 8 GPUs in its proportions (a quarter V100
nodes, the rest P100, ClusterSpec.scaled; made here, not shipped), gpt:paper with a global
batch of 32 per device; also reports the number of classes of interchangeable devices the
planner works on (cost_models.device_classes).

Pipeline: gpt:paper (its preset batch) with the given number of layers on the whole
hap-paper cluster (64 devices), planned as `hetsynth plan --stages auto` does: the SPMD plan
(hetsynth.plan: capture, search, LP and baselines), then planner.pipeline.auto_stages. Its time is split into the
stage DP (planner.stage_dp.choose_stages: cuts, sub-meshes, M, schedule by the roofline) and
the stage synthesis (the DP's top candidates: micro-batch capture, each stage's search and LP
on its sub-cluster, boundaries, the schedule simulation). Growth in layers is fitted as
t = c L^k (least squares on log t against log L) and as a line t = a + b L; k <= 1 is at most
linear. Wall and CPU time (time.process_time) are both recorded: on a shared machine the CPU
time is the steadier measure of growth. `--dp-only` layer counts run the stage DP alone (cheap), to show it past the 24
segments its cuts are coarsened to.

Shapes: a Llama-3-8B shape (hf:llama, 32 layers, hidden 4096, GQA 32/8, FFN 11008, sequence
512) and a 70B one (80 layers, hidden 8192, GQA 64/8, FFN 28672) on hap-paper (64 devices) and
on it scaled to 1,024, batch max(64, devices): the whole `hetsynth plan` command's wall time
and peak memory (a fresh process, no plan cache: what a user waits for), then in another
process its parts: capture, the SPMD plan (search, ratio LP, memory fitting, its search and LP
seconds), the baselines, and that process's peak memory.

Each other point runs in a fresh process and measures the synthesis (A* search with its
incumbents, LP, alternation rounds; baselines excluded) and the process's peak RSS. Prints
tables, writes bench/results/synthesis_time.json. For reference, HAP's own search on such a
machine (EuroSys'24 artifact, ViT, 8 devices): 12 layers 1.5-2.4 s, 24 layers 7-10 s, 48
layers 28-54 s, 64 layers 67-115 s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hetsynth.instruction_set.cluster import load_cluster

from common import RESULTS, ROOT, markdown_table, print_table, print_tables, run_child, write_json

PREAMBLE = """
import json, resource, time
from hetsynth import capture_model
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.planner.planner import search_plan
"""

SEARCH = """
start = time.perf_counter()
best, stats = search_plan(graph, cluster, progress=False)
seconds = time.perf_counter() - start
from hetsynth.planner.problem import Problem
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


PIPELINE = PREAMBLE + """
import hetsynth.planner.stage_dp as stage_dp
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.planner.pipeline import auto_stages, block_starts
import hetsynth
clocks = lambda: (time.perf_counter(), time.process_time())
ref = "gpt:paper,num_layers={layers}"
cluster = load_cluster("configs/clusters/hap-paper.toml")
t0 = clocks()
spmd = hetsynth.plan(ref, cluster=cluster, stages=1)  # the SPMD plan; auto_stages below
t1 = clocks()
dp = [0.0, 0.0]
choose = stage_dp.choose_stages
def timed(*args, **kwargs):  # auto_stages imports choose_stages when called: this times its DP
    a = clocks()
    out = choose(*args, **kwargs)
    b = clocks()
    dp[0], dp[1] = dp[0] + b[0] - a[0], dp[1] + b[1] - a[1]
    return out
stage_dp.choose_stages = timed
plan = auto_stages(spmd, parse_model_ref(ref))
t2 = clocks()
p = plan.pipeline
times = {{}}
for k, unit in enumerate(("seconds", "cpu_seconds")):
    times |= {{f"spmd_{{unit}}": t1[k] - t0[k], f"stage_dp_{{unit}}": dp[k],
              f"stage_synthesis_{{unit}}": t2[k] - t1[k] - dp[k], f"stage_search_{{unit}}": t2[k] - t1[k],
              unit: t2[k] - t0[k]}}
print(json.dumps({{**times, "spmd_search_seconds": spmd.synthesis.seconds, "ops": len(spmd.graph.calls),
                  "segments": len(stage_dp.segments(spmd.graph, block_starts(spmd.graph)).flops),
                  "batch": spmd.model.batch_size, "spmd_step_s": spmd.predicted.step_time_s,
                  "pipeline_step_s": p.predicted.step_time_s if p else None,
                  "stages": len(p.stages) if p else 0, "micro_batches": len(p.micro_batches) if p else 0,
                  "schedule": p.schedule.value if p else None, "shape": plan.shape.value,
                  "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}}))
"""


DP_ONLY = PREAMBLE + """
import hetsynth.planner.stage_dp as stage_dp
from hetsynth.planner.pipeline import block_starts
from hetsynth.planner.planner import model_info
cluster = load_cluster("configs/clusters/hap-paper.toml")
graph = capture_model("gpt:paper,num_layers={layers}")
start, cpu = time.perf_counter(), time.process_time()
found = stage_dp.choose_stages(graph, cluster, block_starts(graph), batch=model_info(graph).batch_size)
dp_s, dp_cpu_s = time.perf_counter() - start, time.process_time() - cpu
print(json.dumps({{"stage_dp_seconds": dp_s, "stage_dp_cpu_seconds": dp_cpu_s, "ops": len(graph.calls),
                  "segments": len(stage_dp.segments(graph, block_starts(graph)).flops),
                  "best": found[0].describe() if found else None}}))
"""


LLAMA = "hf:llama,num_layers={layers},hidden={hidden},num_heads={heads},num_kv_heads=8,ffn_hidden={ffn},vocab_size=32000,seq_len=512"
SHAPES = {"llama3-8b": LLAMA.format(layers=32, hidden=4096, heads=32, ffn=11008),
          "llama-70b": LLAMA.format(layers=80, hidden=8192, heads=64, ffn=28672)}

# the parts of `hetsynth plan`: capture, the SPMD plan (search, LP, memory fitting) and the baselines
SHAPE = PREAMBLE + """
from hetsynth.planner import baselines
from hetsynth.planner.planner import make_plan
cluster = load_cluster("{cluster}")
t0 = time.perf_counter()
graph = capture_model("{ref}")
t1 = time.perf_counter()
plan = make_plan(graph, cluster, progress=False, with_baselines=False, keep_unfit=True)
t2 = time.perf_counter()
baselines.all_baselines(graph, cluster, width=32)
t3 = time.perf_counter()
print(json.dumps({{"capture_seconds": t1 - t0, "plan_seconds": t2 - t1, "search_seconds": plan.synthesis.search_seconds,
                  "lp_seconds": plan.synthesis.lp_seconds, "baselines_seconds": t3 - t2, "ops": len(graph.calls),
                  "states_expanded": plan.synthesis.states_expanded, "predicted_step_s": plan.predicted.step_time_s,
                  "fits": plan.predicted.fits,
                  "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}}))
"""


def _cluster_file(devices: int, folder: Path) -> Path:
    """hap-paper itself (64 devices) or scaled to `devices` / 8 nodes, as a spec file the CLI reads."""
    if devices == 64:
        return ROOT / "configs/clusters/hap-paper.toml"
    path = folder / f"hap-paper-x{devices // 8}.json"
    path.write_text(load_cluster(ROOT / "configs/clusters/hap-paper.toml").scaled(devices // 8).model_dump_json())
    return path


def _command(ref: str, cluster: Path, folder: Path) -> dict:
    """Wall time and peak memory (this child's own, os.wait4) of the whole `hetsynth plan`, in a
    fresh process with an empty plan cache."""
    with open(folder / "out.txt", "w") as out, open(folder / "err.txt", "w") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "hetsynth", "plan", "--model", ref, "--cluster", str(cluster),
                                 "--no-cache", "--out", str(folder / "plan.json")], stdout=out, stderr=err, cwd=ROOT,
                                env=os.environ | {"HETSYNTH_CACHE_DIR": str(folder / "cache")})
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        lines = (folder / "err.txt").read_text().strip().splitlines()
        return {"command_error": lines[-1] if lines else f"status {status}", "command_seconds": seconds}
    return {"command_seconds": seconds, "command_peak_rss_gib": usage.ru_maxrss / 2**20}


def shapes(devices_list: list[int], names: list[str], results: dict) -> None:
    """Real model shapes (Llama-3-8B, a 70B) on hap-paper and its scaled copies: the whole
    command's wall time, and its parts measured in a second process."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in names:
            for devices in devices_list:
                batch = max(64, devices)  # one sample per device at least
                ref = f"{SHAPES[name]},batch_size={batch}"
                cluster = _cluster_file(devices, folder)
                r = _command(ref, cluster, folder) | run_child(SHAPE.format(cluster=cluster, ref=ref))
                results[f"shape/{name}/{devices}"] = {"model": name, "ref": ref, "devices": devices, **r}
                if "error" in r:
                    rows.append([name, devices, "error", r["error"], "", "", "", "", "", ""])
                else:
                    rows.append([name, devices, r["ops"], f"{r['command_seconds']:.1f}" if "command_seconds" in r else "",
                                 f"{r['capture_seconds']:.1f}", f"{r['plan_seconds']:.1f}", f"{r['search_seconds']:.1f}",
                                 f"{r['lp_seconds']:.2f}", f"{r['baselines_seconds']:.1f}", f"{r['peak_rss_gib']:.2f}"])
                print(rows[-1], flush=True)
    print_tables(rows, ["model", "devices", "ops", "hetsynth plan s", "capture s", "SPMD plan s", "of it search s",
                        "of it LP s", "baselines s", "peak GiB"])


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


def growth(layers: list[int], seconds: list[float]) -> dict[str, float]:
    """t = c L^k fitted on logs (k: the growth exponent) and t = a + b L (b: seconds per layer)."""
    x, y = np.array(layers, float), np.array(seconds, float)
    k = float(np.polyfit(np.log(x), np.log(y), 1)[0])
    b, a = (float(v) for v in np.polyfit(x, y, 1))
    return {"exponent": k, "seconds_per_layer": b, "intercept_s": a}


PARTS = {"stage DP": "stage_dp_seconds", "stage synthesis": "stage_synthesis_seconds",
         "stage search (DP + synthesis)": "stage_search_seconds", "SPMD plan": "spmd_seconds",
         "whole planning": "seconds"}


def pipeline(layers_list: list[int], results: dict) -> None:
    rows, done = [], []
    for layers in layers_list:
        r = run_child(PIPELINE.format(layers=layers))
        results[f"gpt-pipeline/{layers}"] = {"devices": 64, "layers": layers, "model": "gpt:paper", **r}
        if "error" in r:
            rows.append([layers, "error", r["error"], "", "", "", "", "", "", "", ""])
        else:
            done.append(r | {"layers": layers})
            shape = (f"{r['stages']} st, M={r['micro_batches']}, {r['schedule']}" if r["stages"] else "none fits")
            rows.append([layers, r["ops"], r["segments"], f"{r['spmd_seconds']:.2f}", f"{r['stage_dp_seconds']:.2f}",
                         f"{r['stage_synthesis_seconds']:.2f}", f"{r['seconds']:.2f}",
                         f"{r['stage_search_cpu_seconds']:.2f}", shape,
                         f"{r['spmd_step_s'] * 1e3:.1f}",
                         f"{r['pipeline_step_s'] * 1e3:.1f}" if r["pipeline_step_s"] else "-"])
        print(rows[-1], flush=True)
    header = ["layers", "ops", "segments", "SPMD plan s", "stage DP s", "stage synthesis s", "total s",
              "stage search CPU s", "pipeline found", "SPMD ms", "pipeline ms"]
    print()
    print_table(rows, header)
    print("\n" + markdown_table(rows, header))
    if len(done) < 2:
        return
    for clock, suffix in (("wall", "seconds"), ("CPU", "cpu_seconds")):
        fits = {name: growth([r["layers"] for r in done], [r[key.replace("seconds", suffix)] for r in done])
                for name, key in PARTS.items()}
        results[f"gpt-pipeline/growth/{clock.lower()}"] = fits
        print(f"\ngrowth over {done[0]['layers']}..{done[-1]['layers']} layers, {clock} time (t = c L^k; t = a + b L):")
        for name, f in fits.items():
            verdict = "at most linear" if f["exponent"] <= 1.0 else "faster than linear"
            print(f"  {name}: k = {f['exponent']:.2f} ({verdict}), b = {f['seconds_per_layer']:.3f} s/layer")


def dp_only(layers_list: list[int], results: dict) -> None:
    """The stage DP alone at more layers: its cuts are coarsened to at most 24 segments, so past
    24 blocks its time stops growing (only the segment sums, linear in the calls, do)."""
    rows = []
    for layers in layers_list:
        r = run_child(DP_ONLY.format(layers=layers))
        results[f"gpt-pipeline/dp-only/{layers}"] = {"devices": 64, "layers": layers, "model": "gpt:paper", **r}
        rows.append([layers, "error", r["error"], "", ""] if "error" in r else
                    [layers, r["ops"], r["segments"], f"{r['stage_dp_seconds']:.2f}", f"{r['stage_dp_cpu_seconds']:.2f}"])
        print(rows[-1], flush=True)
    print_tables(rows, ["layers", "ops", "segments", "stage DP s (alone)", "stage DP CPU s"])


def previous(skipped: list[str]) -> dict:
    """The last run's entries of the sections skipped this time (kept in the JSON)."""
    path = RESULTS / "synthesis_time.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    section = lambda key: ("pipeline" if key.startswith("gpt-pipeline/") else  # noqa: E731
                           "scale" if key.startswith("gpt-scale/") else
                           "shapes" if key.startswith("shape/") else "layers")
    return {k: v for k, v in old.items() if section(k) in skipped}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 4, 12, 24, 48, 64])
    parser.add_argument("--scale", type=int, nargs="+", default=[64, 256, 1024, 4096],
                        help="device counts for gpt:paper on hap-paper-like clusters (multiples of 8)")
    parser.add_argument("--pipeline", type=int, nargs="+", default=[6, 12, 24, 48],
                        help="layer counts of gpt:paper planned with stages considered on the 64 devices")
    parser.add_argument("--dp-only", type=int, nargs="*", default=[96],
                        help="further layer counts where only the stage DP runs (after capture)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES),
                        help="real model shapes planned on hap-paper (64 devices) and its copy scaled to 1,024")
    parser.add_argument("--shape-devices", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--skip-layers", action="store_true")
    parser.add_argument("--skip-shapes", action="store_true")
    parser.add_argument("--skip-scale", action="store_true")
    parser.add_argument("--skip-pipeline", action="store_true")
    args = parser.parse_args()
    skipped = [name for name in ("layers", "scale", "pipeline", "shapes") if getattr(args, f"skip_{name}")]
    results: dict = previous(skipped)
    if not args.skip_layers:
        depth(args.devices, args.layers, results)
    if not args.skip_scale:
        scale(args.scale, results)
    if not args.skip_pipeline:
        pipeline(args.pipeline, results)
        dp_only(args.dp_only, results)
    if not args.skip_shapes:
        shapes(args.shape_devices, args.shapes, results)
    write_json("synthesis_time.json", results)


if __name__ == "__main__":
    main()
