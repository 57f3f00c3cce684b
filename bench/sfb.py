"""Sufficient-factor broadcasting measured: bytes on the wire and step time with and without SFB.

    python bench/sfb.py [--cases NAME ...] [--rounds 4]

On the emulated cluster (configs/clusters/local-emulated.toml, measured spec as in
bench/measured_speedup.py), for VGG19 small-cpu at batch 32, VGG19's classifier alone
(bench/sfb_models.py) at 32 and 4096 tokens, and a GPT MLP at 64 and 8192 tokens, three plans
train on the same workers, interleaved (runtime.compare):
- dp_sfb: data parallelism (planned ratios) with SFB forced on every linear weight;
- dp_allreduce: the same plan with those weights all-reduced instead
  (planner.planner.without_sfb: same layouts, ratios and shard lengths);
- hetsynth: the planner's own plan, for reference.
It also records which weights data parallelism gives SFB when the cost model decides, and
which hetsynth's own plan does. SFB pays when
tokens < 2 * in * out / (in + out) per layer (3136 x 1024: 1544 tokens; 128 x 512: 205),
minus the rebuild work every device repeats. Also records that the planner does not pick SFB
for GPT small-cpu nor GPT small on the HAP paper cluster. Prints a table, writes
bench/results/sfb.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from common import RESULTS, ROOT, print_tables, write_json
from measured_speedup import measure, profile

sys.path.insert(0, str(ROOT))

MODELS = ROOT / "bench" / "sfb_models.py"
CASES = {
    "vgg19-b32": "vgg:small-cpu,batch_size=32",
    "vgg-classifier-32": f"{MODELS}:vgg_classifier,batch_size=32",
    "vgg-classifier-4096": f"{MODELS}:vgg_classifier,batch_size=4096",
    "gpt-mlp-64": f"{MODELS}:gpt_mlp,batch_size=1,seq_len=64",
    "gpt-mlp-8192": f"{MODELS}:gpt_mlp,batch_size=128,seq_len=64",
}


def sfb_weights(plan) -> list[str]:
    return [i.tensor for i in plan.instructions if i.kind == "sfb"]


def case_plans(ref: str, cluster) -> tuple[dict, list[str]]:
    """{"hetsynth": its own plan, "dp_sfb": data parallelism with SFB on every linear weight,
    "dp_allreduce": the same with all-reduce}, and the weights that data parallelism gives
    SFB when the cost model decides (not forced)."""
    import dataclasses

    import hetsynth
    from hetsynth.planner.planner import DP_SEED, make_plan, without_sfb

    graph = hetsynth.capture_measured(ref, cluster=cluster)
    plan = lambda **r: make_plan(graph, cluster, progress=False, with_baselines=False,
                                 restrictions=dataclasses.replace(DP_SEED, **r))
    split = {n.name: "S0" for n in graph.calls if n.target == "aten.linear.default"}
    forced = plan(force_sfb=True, force=split)
    made = {"hetsynth": make_plan(graph, cluster, progress=False, with_baselines=False),
            "dp_sfb": forced, "dp_allreduce": without_sfb(forced)}
    return made, sfb_weights(plan())


def gpt_choices(measured_spec: Path) -> dict[str, list[str]]:
    """SFB weights in hetsynth's plans at GPT sizes (expected: none)."""
    import hetsynth

    paper = ROOT / "configs" / "clusters" / "hap-paper.toml"
    out = {}
    for ref, cluster, timed in (("gpt:small-cpu", measured_spec, True), ("gpt:small", paper, False)):
        plan = hetsynth.plan(ref, cluster=str(cluster), measure_ops=timed, stages=1)  # SFB is an SPMD decision
        out[f"{ref} on {cluster.stem}"] = sfb_weights(plan)
    return out


def run_case(name: str, measured_spec: Path, rounds: int) -> dict:
    import hetsynth

    ref = CASES[name]
    cluster = hetsynth.load_cluster(str(measured_spec))
    made, dp_choice = case_plans(ref, cluster)
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for key, plan in made.items():
            files[key] = (str(Path(tmp) / f"{key}.json"), plan.predicted.step_time_s)
            hetsynth.save_plan(plan, files[key][0])
        times = measure(measured_spec, files, Path(tmp), rounds, 2)
    return {"ref": ref, "sfb_weights": sfb_weights(made["dp_sfb"]), "dp_picks_sfb": dp_choice,
            "hetsynth_picks_sfb": sfb_weights(made["hetsynth"]),
            **{f"{k}_s": times[k]["median_s"] for k in made},
            **{f"predicted_{k}_s": made[k].predicted.step_time_s for k in made},
            "wire_bytes_per_step": {k: times[k]["wire_bytes_per_step"] for k in made},
            "step_seconds": {k: times[k]["step_seconds"] for k in made}}


def row(name: str, r: dict) -> list:
    wire = r["wire_bytes_per_step"]
    return [name, len(r["sfb_weights"]), len(r["dp_picks_sfb"]), len(r["hetsynth_picks_sfb"]),
            f"{wire['dp_sfb'] / 2**20:.2f}", f"{wire['dp_allreduce'] / 2**20:.2f}",
            f"{r['dp_sfb_s']:.3f} ({r['predicted_dp_sfb_s']:.3f})",
            f"{r['dp_allreduce_s']:.3f} ({r['predicted_dp_allreduce_s']:.3f})",
            f"{r['dp_allreduce_s'] / r['dp_sfb_s']:.2f}x",
            f"{r['hetsynth_s']:.3f} ({r['predicted_hetsynth_s']:.3f})"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reprofile", action="store_true")
    parser.add_argument("--merge", action="store_true", help="keep other cases of bench/results/sfb.json")
    args = parser.parse_args()
    measured_spec = profile(args.reprofile)
    previous = RESULTS / "sfb.json"
    results = json.loads(previous.read_text())["cases"] if args.merge and previous.exists() else {}
    rows = []
    for name in args.cases:
        results[name] = run_case(name, measured_spec, args.rounds)
        rows.append(row(name, results[name]))
        print(rows[-1], flush=True)
        write_json("sfb.json", {"cases": results})  # kept if a later case fails
    header = ["case", "linears", "DP picks SFB", "hetsynth picks SFB", "wire MiB/step SFB",
              "wire MiB/step all-reduce", "step s SFB (pred.)", "step s all-reduce (pred.)", "SFB speed-up",
              "hetsynth plan s (pred.)"]
    gpt = gpt_choices(measured_spec)
    rows = [row(name, results[name]) for name in CASES if name in results]
    print_tables(rows, header)
    for key, weights in gpt.items():
        print(f"planner's SFB weights for {key}: {weights or 'none'}")
    write_json("sfb.json", {"cases": results, "gpt_plans_sfb_weights": gpt})


if __name__ == "__main__":
    main()
