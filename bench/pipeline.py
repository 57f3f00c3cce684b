"""Pipeline plans against SPMD on a cluster with a slow link, measured (issue 17).

    python bench/pipeline.py [--reprofile] [--rounds 6] [--steps 2] [--only main|eager|local ...]

Clusters, emulated on this machine (runtime.emulation): configs/clusters/slow-link-emulated.toml,
a fast node (2 workers at 0.5 CPU) and a slow node (2 at 0.25 CPU) joined by a 50 Mbit/s link,
for `main`; configs/clusters/slow-pair-emulated.toml, two nodes of one worker at 0.9 CPU on the
same link, for `eager` (why: that scenario below). Each is profiled first (`hetsynth profile`,
messages up to 4 MiB: larger ones take seconds each on this link; cached in
bench/results/<cluster>-measured.toml, --reprofile measures again), and every plan is made for
the measured spec with the model's ops timed on this machine and on the emulated devices
(`hetsynth plan --measure-ops`), each micro-batch size's ops too.

Scenarios:
- `main`: GPT `small-cpu` with 4 layers of hidden 256 (ffn 1024), batch 32 x 64 tokens. Its
  parameters are heavy and its boundary activations light: 3.3 M parameters make 13 MB of
  gradients, which every data-parallel step all-reduces across the link (about 2 s at 50
  Mbit/s), while a stage boundary carries one micro-batch's residual stream, b x 64 x 256 x 4
  bytes (128 KiB at b = 2, about 20 ms), each way. Plans: hetsynth's best SPMD plan, DP-CP (the
  data-parallel program at throughput-proportional ratios), and the `--stages auto` pipeline
  (planner.pipeline.auto_stages: the stage DP, its candidates synthesized and simulated) under
  its own schedule and, same stages and micro-batches, under the other two
  (planner.pipeline.with_schedule).
- `eager`: where a boundary transfer takes at least half a stage's micro-batch compute:
  GPT `small-cpu` (2 layers of hidden 128), batch 64, in 2 stages (one per node) of 16
  micro-batches of 4: the boundary moves 128 KiB per micro-batch each way (about 20 ms) against
  a few ms of compute per micro-batch on each stage. Eager-1F1B against 1F1B (and GPipe), the
  same stages; the table gives the predicted C / (F + B) of each stage. It runs on the 0.9 CPU
  pair: a worker held to a small quota (slow-link-emulated's 0.25) computes at full speed for
  its quota and idles the rest of every 10 ms period, and a wait for a transfer falls into
  that idle time at no cost, so there the schedules' exposed transfers do not show (measured:
  eager-1F1B and 1F1B within 1% of each other while the simulation, which takes a device to
  be uniformly slow, gives 1F1B 30% more).
- `local`: planning only, on bench/results/local-emulated-measured.toml (the shipped
  local-emulated.toml, profiled by bench/measured_speedup.py), GPT `small-cpu` with
  `--stages auto`: the planner must keep SPMD there.

All plans of a scenario train on the same workers, interleaved (runtime.compare: 2 warm-up
steps each, then rounds of `--steps` steps of each in turn); the table gives median seconds
per step, the prediction and its error, and the ratios against the best SPMD plan and DP-CP.
Writes bench/results/pipeline.json as {"models": {NAME: {"cluster", "pipeline_s", "spmd_s",
"dp_cp_s", "pipeline_1f1b_s", "pipeline_gpipe_s", "pipeline_eager_1f1b_s", "predicted_s",
"stages", ...}}, "local_emulated": {...}}. Needs root for the emulation.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from common import compare_plans, RESULTS, ROOT, print_tables, write_json

sys.path.insert(0, str(ROOT))

CLUSTER = ROOT / "configs" / "clusters" / "slow-link-emulated.toml"
EAGER_CLUSTER = ROOT / "configs" / "clusters" / "slow-pair-emulated.toml"
LOCAL_MEASURED = RESULTS / "local-emulated-measured.toml"
MAIN = "gpt:small-cpu,num_layers=4,hidden=256,ffn_hidden=1024,batch_size=32"
EAGER = "gpt:small-cpu,batch_size=64"
SCHEDULES = ("eager_1f1b", "1f1b", "gpipe")


def profile(cluster: Path, force: bool) -> Path:
    """The measured spec of `cluster` (bench/results/<name>-measured.toml), profiled when
    missing or forced."""
    measured = RESULTS / f"{cluster.stem}-measured.toml"
    if force or not measured.exists():
        subprocess.run([sys.executable, "-m", "hetsynth", "profile", "--cluster", str(cluster), "--max-bytes",
                        str(4 * 2**20), "-o", str(measured)], cwd=ROOT, check=True)
    return measured


def _measured_graph(ref: str, cluster):
    import hetsynth
    from hetsynth.profiling.measured import measure_at

    graph = hetsynth.capture_measured(ref, cluster=cluster)
    return graph, measure_at(ref, graph)


def _schedules(pipeline_plan) -> dict:
    from hetsynth.instruction_set.plan import PlanShape
    from hetsynth.instruction_set.schedule import Schedule
    from hetsynth.planner.pipeline import with_schedule

    return {f"pipeline_{s}": with_schedule(pipeline_plan, Schedule(s)).model_copy(update={"shape": PlanShape.PIPELINE})
            for s in SCHEDULES}


def _baselines(ref: str, cluster_path: Path) -> tuple[dict, object]:
    """{"spmd": the best SPMD plan, "dp_cp": DP-CP} of `ref`, and its micro-batch timer."""
    import hetsynth
    from hetsynth.planner import baselines
    from hetsynth.planner.planner import make_plan

    cluster = hetsynth.load_cluster(str(cluster_path))
    graph, measure = _measured_graph(ref, cluster)
    made = {"spmd": make_plan(graph, cluster, progress=False, with_baselines=False),
            "dp_cp": make_plan(graph, cluster, ratios=baselines.proportional(cluster), restrictions=baselines.DP,
                               progress=False, with_baselines=False)}
    return made, measure


def _facts(plan) -> dict:
    return {"chosen_shape": str(plan.shape), "chosen_schedule": str(plan.pipeline.schedule),
            "stages": describe(plan), "transfer_vs_compute": transfer_ratios(plan), "stage_terms": stage_terms(plan)}


def main_plans(cluster_path: Path) -> tuple[dict, dict]:
    """name -> Plan: spmd, dp_cp and the auto pipeline under each schedule; and facts."""
    from hetsynth.instruction_set.models import parse_model_ref
    from hetsynth.planner.pipeline import auto_stages

    made, measure = _baselines(MAIN, cluster_path)
    chosen = auto_stages(made["spmd"], parse_model_ref(MAIN), measure=measure)
    if chosen.pipeline is None:
        raise SystemExit("error: --stages auto found no pipeline for the main scenario (see the log)")
    return made | _schedules(chosen), _facts(chosen)


def eager_plans(cluster_path: Path) -> tuple[dict, dict]:
    """The same for the eager scenario's 2 stages of 16 micro-batches (`--stages 2`)."""
    from hetsynth.instruction_set.models import parse_model_ref
    from hetsynth.planner.pipeline import plan_stages

    made, measure = _baselines(EAGER, cluster_path)
    staged = plan_stages(made["spmd"], parse_model_ref(EAGER), 2, num_micro=16, measure=measure)
    return made | _schedules(staged), _facts(staged)


def describe(plan) -> str:
    p = plan.pipeline
    parts = [f"stage {s.index}: ranks {s.first_rank}-{s.ranks.stop - 1}, calls {s.calls[0]}-{s.calls[1] - 1}"
             for s in p.stages]
    return f"{len(p.stages)} stages ({'; '.join(parts)}), M={len(p.micro_batches)} x {max(p.micro_batches)}"


def stage_terms(plan) -> list[dict]:
    """Per stage, the predicted seconds per step of its forward and backward halves (summed over
    the micro-batches, planner.stage_times.stage_phases), of the CPU of the transfers it sends
    (charged to its actions) and of those it receives (charged where it is busy while the data
    arrives: cost_models.schedule), to set against the measured `actions.forward` and
    `actions.backward` of its ranks."""
    from hetsynth.planner.stage_times import boundary_cpus, receive_cpu, stage_phases, stage_times

    p = plan.pipeline
    cpus = boundary_cpus(p.stages, p.boundaries, p.micro_batches)
    times = stage_times(p.stages, p.boundaries, p.micro_batches, cpus)
    received = receive_cpu(cpus)
    out = []
    for st, t in zip(p.stages, times):
        f = sum(stage_phases(st.plans[b]).forward_s for b in p.micro_batches)
        b = sum(stage_phases(st.plans[b]).backward_s for b in p.micro_batches)
        into = [(i, "F") for i, bd in enumerate(p.boundaries) if bd.dst_stage == st.index] + \
               [(i, "B") for i, bd in enumerate(p.boundaries) if bd.src_stage == st.index]
        out.append({"stage": st.index, "forward_s": f, "backward_s": b,
                    "send_cpu_s": sum(t.forward_s) + sum(t.backward_s) - f - b,
                    "receive_cpu_s": sum(sum(received[c]) for c in into), "sync_s": t.sync_s})
    return out


def transfer_ratios(plan) -> list[dict]:
    """Per boundary: its predicted transfer C at the largest micro-batch and C / (F + B) of
    the stages at both ends (planner.stage_times)."""
    from hetsynth.planner.stage_times import stage_phases

    p = plan.pipeline
    b = max(p.micro_batches)
    out = []
    for bd in p.boundaries:
        c = bd.reshard[b].predicted_s
        ends = [stage_phases(p.stages[s].plans[b]) for s in (bd.src_stage, bd.dst_stage)]
        out.append({"tensor": bd.tensor, "transfer_s": c,
                    "c_over_f_plus_b": [c / (e.forward_s + e.backward_s) for e in ends]})
    return out


def local_check() -> dict:
    """Planning only: on the shipped local-emulated cluster the planner keeps SPMD."""
    import hetsynth
    from hetsynth.instruction_set.models import parse_model_ref
    from hetsynth.planner.pipeline import auto_stages
    from hetsynth.planner.planner import make_plan

    ref = "gpt:small-cpu"
    cluster = hetsynth.load_cluster(str(LOCAL_MEASURED))
    graph, measure = _measured_graph(ref, cluster)
    spmd = make_plan(graph, cluster, progress=False, with_baselines=False)
    chosen = auto_stages(spmd, parse_model_ref(ref), measure=measure)
    piped = chosen.pipeline.predicted.step_time_s if chosen.pipeline else None
    return {"model": ref, "measured_spec": str(LOCAL_MEASURED.relative_to(ROOT)), "shape": str(chosen.shape),
            "spmd_predicted_s": spmd.predicted.step_time_s, "pipeline_predicted_s": piped,
            "pipeline": describe(chosen) if chosen.pipeline else None}


def predicted(plan) -> float:
    return plan.pipeline.predicted.step_time_s if plan.pipeline is not None else plan.predicted.step_time_s


def rows(model: str, made: dict, times: dict) -> tuple[list[list[str]], dict]:
    base = {k: times[k]["median_s"] for k in ("spmd", "dp_cp") if k in times}
    out, entries = [], {}
    for name in made:
        t, p = times[name]["median_s"], predicted(made[name])
        entries[name] = {"measured_s": t, "predicted_s": p, "error": p / t - 1,
                         "phases_by_rank": times[name]["phases_by_rank"], "step_seconds": times[name]["step_seconds"]}
        out.append([model, name, f"{t:.3f}", f"{p:.3f}", f"{p / t - 1:+.1%}",
                    *(f"{base[k] / t:.2f}x" if k in base else "-" for k in ("spmd", "dp_cp"))])
    return out, entries


def result(cluster: Path, facts: dict, entries: dict) -> dict:
    chosen = f"pipeline_{facts.get('chosen_schedule', 'eager_1f1b')}"
    r = {"cluster": cluster.stem, "stages": facts["stages"], "plans": entries, **facts}
    r |= {f"{k}_s": v["measured_s"] for k, v in entries.items() if k in ("spmd", "dp_cp")}
    r |= {f"{k}_s": v["measured_s"] for k, v in entries.items() if k.startswith("pipeline_")}
    if chosen in entries:
        r |= {"pipeline_s": entries[chosen]["measured_s"], "predicted_s": entries[chosen]["predicted_s"]}
    return r


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reprofile", action="store_true")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", nargs="+", choices=("main", "eager", "local"), default=["main", "eager", "local"])
    args = parser.parse_args()
    results: dict = {"models": {}}
    table = []
    for name, ref, make, cluster in (("main", MAIN, main_plans, CLUSTER), ("eager", EAGER, eager_plans, EAGER_CLUSTER)):
        if name not in args.only:
            continue
        spec = profile(cluster, args.reprofile)
        made, facts = make(spec)
        print(f"{name}: {ref}: {facts['stages']}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            times = compare_plans(spec, made, Path(tmp), args.rounds, args.steps)
        got, entries = rows(name, made, times)
        table += got
        results["models"][f"{name}: {ref}"] = result(cluster, facts, entries)
        for r in got:
            print(r, flush=True)
    if "local" in args.only:
        results["local_emulated"] = local_check()
        print("local-emulated:", results["local_emulated"], flush=True)
    print_tables(table, ["scenario", "plan", "measured s", "predicted s", "error", "best SPMD / it", "DP-CP / it"])
    write_json("pipeline.json", results)


if __name__ == "__main__":
    main()
