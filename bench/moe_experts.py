"""Expert parallelism for a HuggingFace MoE model, measured against replicated experts (issue 35).

    python bench/moe_experts.py [--reprofile] [--runs 3] [--rounds 6] [--steps 2] [--batch 8] [--seq 16]

Model: `hf:mixtral,experts=routed` with one layer of hidden 256, 8 experts of FFN 1024, top-2
(the experts are 25 MB of its 33 MB of float32 weights), batch `--batch` x `--seq` tokens.
Cluster: configs/clusters/local-emulated.toml (a fast node of two 0.5-CPU workers and a slow
node of two 0.25-CPU workers, 200 Mbit/s between them), profiled first (`hetsynth profile`,
cached as bench/results/local-emulated-measured.toml; --reprofile measures again); every plan is
made for the measured spec with the model's ops timed on this machine and on the emulated
devices (`hetsynth plan --measure-ops`).

Plans, all trained on the same four workers, interleaved (runtime.compare: 2 warm-up steps
each, then rounds of `--steps` steps of each in turn):
- `chosen`: the planner's own plan (it splits the experts, more of them on the fast devices;
  which way the tokens reach them is its choice);
- `gathered`: experts split with every token brought to every rank (local `experts_sharded`:
  the tokens all-gathered, the output reduce-scattered), forced by making the op's output a
  Partial;
- `dispatched`: experts and tokens both split, each (token, expert) pair sent to its
  expert's rank and back (local `experts_dispatched`: an all-to-all each way), forced by
  making the op's output split by tokens while its experts are split;
- `replicated`: the best plan with every expert weight forced replicated (tokens may split,
  so the experts train data-parallel and their gradients are all-reduced);
- `dp_cp`: data parallelism at throughput-proportional ratios (the DP-CP baseline).

The whole is repeated `--runs` times (planning included: the measured op times, and so the
predictions, vary from run to run as much as the steps do). The table gives, per plan, the
median over the runs of: median seconds per step, the prediction, its error ((predicted -
measured) / measured) and how much faster the plan is than the replicated-experts plan, each
with its range. Writes bench/results/moe_experts.json as {"model", "cluster", "runs": [{NAME:
{"measured_s", "predicted_s", "error", "experts" (per rank), "local", "step_seconds",
"phases_by_rank"}}], "summary": {NAME: {"experts", "measured_s", "predicted_s", "error",
"vs_replicated"}, each a {"median", "min", "max"} but experts and local}}. Needs root for the emulation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from common import compare_plans, ROOT, print_tables, profiled, write_json

sys.path.insert(0, str(ROOT))

CLUSTER = ROOT / "configs" / "clusters" / "local-emulated.toml"
MODEL = "hf:mixtral,experts=routed,num_layers=1,hidden=256,ffn_hidden=1024,num_local_experts=8,num_heads=4"


def expert_weights(graph) -> list[str]:
    """The gate_up and down weights of every routed-experts op."""
    from hetsynth.instruction_set.experts_op import OP

    return [t for n in graph.calls if n.target == OP for t in n.inputs[3:5]]


def experts_of(plan) -> tuple[str, list[int]]:
    """How the first routed-experts op runs (its rule's local: `experts_sharded`,
    `experts_dispatched`, or "" where the experts are whole) and how many experts each rank
    holds."""
    from hetsynth.instruction_set.experts_op import OP

    for ins in plan.instructions:
        if ins.kind == "compute" and ins.node and plan.graph.node(ins.node).target == OP:
            node = plan.graph.node(ins.node)
            experts = plan.graph.node(node.inputs[3]).out.shape[0]
            if "experts_" not in ins.local:
                return "", [experts] * len(plan.sharding_ratios)
            return ins.local, [int(n) for n in plan.lengths(node.inputs[3], ins.inputs[3])[0]]
    raise SystemExit("error: the plan has no routed-experts op")


def make_plans(ref: str, cluster_path: Path) -> dict:
    """name -> Plan: the planner's choice, the two ways of splitting the experts, experts
    forced replicated, DP-CP."""
    import hetsynth
    from hetsynth.instruction_set.experts_op import OP
    from hetsynth.planner import baselines
    from hetsynth.planner.planner import make_plan
    from hetsynth.planner.problem import Restrictions

    cluster = hetsynth.load_cluster(str(cluster_path))
    graph = hetsynth.capture_measured(ref, cluster=cluster)
    replicated = Restrictions(force={t: "R" for t in expert_weights(graph)})
    ops = [n.name for n in graph.calls if n.target == OP]
    gathered = Restrictions(force={n: "P" for n in ops})
    dispatched = Restrictions(force={n: "S0" for n in ops} | {t: "S0" for t in expert_weights(graph)})
    return {"chosen": make_plan(graph, cluster, progress=False, with_baselines=False),
            "gathered": make_plan(graph, cluster, restrictions=gathered, progress=False, with_baselines=False),
            "dispatched": make_plan(graph, cluster, restrictions=dispatched, progress=False, with_baselines=False),
            "replicated": make_plan(graph, cluster, restrictions=replicated, progress=False, with_baselines=False),
            "dp_cp": make_plan(graph, cluster, ratios=baselines.proportional(cluster), restrictions=baselines.DP,
                               progress=False, with_baselines=False)}


def entries(made: dict, times: dict) -> dict:
    return {name: {"measured_s": times[name]["median_s"], "predicted_s": plan.predicted.step_time_s,
                   "error": plan.predicted.step_time_s / times[name]["median_s"] - 1,
                   "vs_replicated": times["replicated"]["median_s"] / times[name]["median_s"],
                   "experts": experts_of(plan)[1], "local": experts_of(plan)[0], "step_seconds": times[name]["step_seconds"],
                   "phases_by_rank": times[name]["phases_by_rank"]}
            for name, plan in made.items()}


def summary(runs: list[dict]) -> dict:
    """Per plan: the median, least and largest over the runs of each figure."""
    def ranged(values: list[float]) -> dict:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {name: {"experts": runs[-1][name]["experts"], "local": runs[-1][name]["local"],
                   **{k: ranged([r[name][k] for r in runs]) for k in FIGURES}} for name in runs[0]}


FIGURES = ("measured_s", "predicted_s", "error", "vs_replicated")


def row(name: str, s: dict) -> list[str]:
    fmt = {"measured_s": "{:.3f}", "predicted_s": "{:.3f}", "error": "{:+.1%}", "vs_replicated": "{:.2f}x"}
    return [name, s["local"] or "whole", "/".join(map(str, s["experts"]))] + [
        f"{fmt[k].format(s[k]['median'])} ({fmt[k].format(s[k]['min'])} to {fmt[k].format(s[k]['max'])})"
        for k in FIGURES]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reprofile", action="store_true")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=16)
    args = parser.parse_args()
    ref = f"{MODEL},batch_size={args.batch},seq_len={args.seq}"
    spec = profiled(CLUSTER, args.reprofile)
    runs = []
    for k in range(args.runs):
        made = make_plans(ref, spec)
        with tempfile.TemporaryDirectory() as tmp:
            runs.append(entries(made, compare_plans(spec, made, Path(tmp), args.rounds, args.steps)))
        print(f"run {k + 1}: " + ", ".join(f"{n} {e['measured_s']:.3f} s (predicted {e['predicted_s']:.3f})"
                                         for n, e in runs[-1].items()), flush=True)
    total = summary(runs)
    print_tables([row(name, s) for name, s in total.items()],
                 ["plan", "experts", "experts per rank", "measured s", "predicted s", "error", "replicated / it"])
    write_json("moe_experts.json", {"model": ref, "cluster": CLUSTER.stem, "runs": runs, "summary": total})


if __name__ == "__main__":
    main()
