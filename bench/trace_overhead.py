"""What tracing costs a training step (issue 19: within 5%), on the demo's plan.

The demo's plan (GPT small-cpu on the local emulated cluster, planned as `make demo` plans
it, hetsynth.demo.make_plans) trains on the emulated cluster (runtime.compare --traced): in
every round one step with the plain program, then one step with every instruction timed
(runtime.timing), on the same trainer, each after a barrier. Reported: the median step time
of each (rank 0's wall time of the step, as runtime.train measures it), their ratio, and the
median of the per-round ratios (traced / untraced of the same round). Writes
bench/results/trace_overhead.json. Run it under the machine lock (it times things).

    python bench/trace_overhead.py [--rounds 20] [--model gpt:small-cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_json  # noqa: E402


def measure(model: str, rounds: int, warmup: int) -> dict:
    from hetsynth.demo import demo_cluster, make_plans
    from hetsynth.measured import comparison, measured_trace, read_raw
    from hetsynth.instruction_set.plan import save_plan
    from hetsynth.runtime import emulation
    from hetsynth.runtime.launch import launch_checked, recorded_run

    args = argparse.Namespace(cluster="configs/clusters/local-emulated.toml", profile=False)
    cluster, source = demo_cluster(args)
    plan = make_plans(model, cluster)["hetsynth"]
    with recorded_run() as (_, tmp):
        save_plan(plan, tmp / "plan.json")
        raw = tmp / "trace"
        raw.mkdir(mode=0o777)
        launch_checked(cluster, ["-m", "hetsynth.runtime.compare", "--plans", str(tmp / "plan.json"), "--names", "hetsynth",
                                 "--warmup", str(warmup), "--rounds", str(rounds), "--steps", "1",
                                 "--report", str(tmp / "report.json"), "--traced", "hetsynth",
                                 "--trace-raw", str(raw)], "the trace-overhead run")
        report = json.loads((tmp / "report.json").read_text())["traced"]
        result = comparison(plan, measured_trace(plan, read_raw(raw, plan.cluster.num_devices)))
    plain, traced = report["untraced_step_seconds"], report["step_seconds"]
    return {"model": model, "cluster": source, "emulated": emulation.unavailable() is None,
            "num_devices": plan.cluster.num_devices, "num_instructions": len(plan.instructions),
            "timed_instructions": len(result["instructions"]), "rounds": rounds,
            "untraced_step_s": plain, "traced_step_s": traced,
            "untraced_median_s": statistics.median(plain), "traced_median_s": statistics.median(traced),
            "ratio_of_medians": statistics.median(traced) / statistics.median(plain),
            "median_paired_ratio": statistics.median(t / u for t, u in zip(traced, plain)),
            "predicted_step_s": plan.predicted.step_time_s, "measured_step_s_traced_run": result["step"]["measured_s"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt:small-cpu")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    r = measure(args.model, args.rounds, args.warmup)
    print_table([["untraced", f"{r['untraced_median_s'] * 1e3:.1f}", "1.000"],
                 ["traced (every instruction timed)", f"{r['traced_median_s'] * 1e3:.1f}",
                  f"{r['ratio_of_medians']:.3f}"]],
                ["steps of the demo's plan", "median ms", "vs untraced"])
    print(f"median of the {r['rounds']} per-round ratios (traced / untraced): {r['median_paired_ratio']:.3f}; "
          f"{r['timed_instructions']} instructions timed on {r['num_devices']} ranks"
          f"{'' if r['emulated'] else ' (NOT emulated: plain local processes)'}")
    verdict = "within" if r["ratio_of_medians"] <= 1.05 else "NOT within"
    print(f"tracing overhead {100 * (r['ratio_of_medians'] - 1):+.1f}%: {verdict} 5%")
    print(f"wrote {write_json('trace_overhead.json', r)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
