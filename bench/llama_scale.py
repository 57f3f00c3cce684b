"""A Llama of 32 layers at hidden 4096 (Llama 3 8B's shape, 32,000-token vocabulary), shape
only, captured and planned for the HAP cluster (64 devices, 8 x 8 mesh), in a fresh process.

    python bench/llama_scale.py [extra,overrides]

Prints capture and planning seconds (the plan with and without its baselines DP-EV, DP-CP and
Megatron) and writes bench/results/llama_scale.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_tables, run_child, write_json  # noqa: E402

REF = ("hf:llama,num_layers=32,hidden=4096,num_heads=32,num_kv_heads=8,ffn_hidden=11008,"
       "vocab_size=32000,seq_len=512,batch_size=64")

CHILD = """
import json, time
import hetsynth
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.planner.planner import make_plan
start = time.perf_counter()
graph = hetsynth.capture_model({ref!r})
captured = time.perf_counter()
cluster = load_cluster("configs/clusters/hap-paper.toml")
plan = make_plan(graph, cluster, progress=False, with_baselines={baselines})
done = time.perf_counter()
print(json.dumps({{"capture_s": captured - start, "plan_s": done - captured, "total_s": done - start,
                  "ops": len(graph.calls), "params": graph.num_params, "states": plan.synthesis.states_expanded,
                  "predicted_s": plan.predicted.step_time_s,
                  "max_memory_gib": max(d.memory_gib for d in plan.predicted.devices),
                  "baselines": {{k: {{"step_time_s": v.step_time_s, "fits": v.fits, "max_memory_gib": v.max_memory_gib}}
                                for k, v in plan.baselines.items()}}}}))
"""


def main(extra: str) -> None:
    ref = REF + ("," + extra if extra else "")
    rows, data = [], {}
    for baselines in (False, True):
        r = run_child(CHILD.format(ref=ref, baselines=baselines))
        data["with_baselines" if baselines else "plan_only"] = r
        if "error" in r:
            rows.append([str(baselines), r["error"], "", "", "", ""])
            continue
        rows.append([str(baselines), f"{r['capture_s']:.1f}", f"{r['plan_s']:.1f}", f"{r['total_s']:.1f}",
                     f"{r['ops']:,}", f"{r['predicted_s']:.3f}"])
    print_tables(rows, ["baselines", "capture s", "plan s", "total s", "ops", "predicted step s"])
    write_json("llama_scale.json", {"ref": ref, **data})


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
