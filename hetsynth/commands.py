"""Subcommands of the CLI: each is (add_arguments, run) in COMMANDS."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from hetsynth import plan_cache  # not hetsynth.api or hetsynth.report: a cached plan is printed without torch
from hetsynth.instruction_set.files import write_atomic
from hetsynth.runtime.config import add_train_arguments, train_config
from hetsynth.runtime.outputs import check_outputs, model_file

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from hetsynth.instruction_set.plan import Plan
    from hetsynth.runtime.launch import RunResult


def _print_json(data: object) -> None:
    print(json.dumps(data, indent=2, default=str))


def inspect_args(p: argparse.ArgumentParser) -> None:
    """validate a cluster spec or capture a model and print its summary"""
    p.add_argument("--model", help="model reference, e.g. gpt:tiny or vit:paper,num_layers=24")
    p.add_argument("--cluster", help="cluster spec (.toml or .json)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--allow-replicate-fallback", action="store_true",
                   help="accept ops without a sharding rule as replicated-only ops")


def inspect_run(args: argparse.Namespace) -> int:
    from hetsynth import capture_model
    from hetsynth.instruction_set.cluster import load_cluster
    from hetsynth.planner.capture import summarize
    from hetsynth.report import cluster_summary, cluster_summary_text, graph_summary_text

    if not args.model and not args.cluster:
        raise ValueError("inspect needs --model REF and/or --cluster FILE")
    out: dict = {}
    if args.cluster:
        out["cluster"] = cluster_summary(load_cluster(args.cluster))
    if args.model:
        graph = capture_model(args.model, allow_replicate_fallback=args.allow_replicate_fallback)
        out["model"] = summarize(graph)
    if args.json:
        _print_json(out)
        return 0
    texts = [cluster_summary_text(out["cluster"])] if "cluster" in out else []
    texts += [graph_summary_text(out["model"])] if "model" in out else []
    print("\n\n".join(texts))
    return 0


def plan_args(p: argparse.ArgumentParser) -> None:
    """synthesize a parallel plan for a model on a cluster and write it as JSON"""
    p.add_argument("--model", required=True, help="model reference, e.g. gpt:small")
    p.add_argument("--cluster", required=True, help="cluster spec (.toml or .json)")
    p.add_argument("--batch-size", type=int, help="global batch size (overrides the preset)")
    p.add_argument("--devices", type=int, help="plan for the first N devices of the cluster")
    p.add_argument("--ratios", help="fix the sharding ratios, e.g. 0.7,0.3 (no LP)")
    p.add_argument("-o", "--output", default="plan.json", help="where to write the plan")
    p.add_argument("--allow-replicate-fallback", action="store_true",
                   help="accept ops without a sharding rule as replicated-only ops")
    p.add_argument("--measure-ops", action="store_true",
                   help="time the model's ops on this machine (for clusters of its CPUs, e.g. emulated)")
    p.add_argument("--data-parallel", action="store_true",
                   help="search data-parallel programs only (ratios, collective variants and SFB still chosen)")
    p.add_argument("--bucket-mb", type=float,
                   help="gradient bucket cap in MiB (default: the one the cost model predicts fastest)")
    p.add_argument("--no-fusion", action="store_true",
                   help="keep every all-gather -> linear and linear -> reduce-scatter as the plain pair "
                        "(default: the cost model fuses them where the overlap pays; planner.fusions)")
    p.add_argument("--zero", choices=["auto", "0", "1", "2", "3"], default="auto",
                   help="sharded training state: auto (ZeRO-1, -2 or -3 only where memory binds, the fastest that "
                        "fits), 0 (never), or 1, 2, 3 (every parameter that can be, rows sized by memory and speed)")
    p.add_argument("--precision", choices=["auto", "bf16", "fp16", "fp32"], default="fp32",
                   help="what each device kind computes in, with float32 master weights and gradient reduction: "
                        "fp32 (default), bf16 or fp16 on every kind (an error where a kind's matmul_flops lacks it), "
                        "or auto (per kind the fastest: bf16 where it has it, else fp16 with loss scaling)")
    p.add_argument("--reduce-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the dtype gradients are reduced across devices in: float32 (default) or bfloat16 (half the "
                        "gradient traffic; the sums rounded to bfloat16, as FSDP2's reduce_dtype does)")
    p.add_argument("--expert-loads", metavar="LOADS",
                   help="each expert's expected share of the routed tokens, for MoE models (default: uniform): "
                        "numbers separated by commas, one per expert, for every MoE layer, or a JSON file with such "
                        "a list or {MoE op name or module path: list}; they price the expert split, not the placement")
    p.add_argument("--json", action="store_true", help="print the plan summary as JSON")
    p.add_argument("--stages", type=_stages_arg,
                   help="pipelines considered beside the SPMD plan: 'auto' (stages, cuts and sub-meshes chosen by "
                        "dynamic programming over block boundaries within every device's memory), a number of "
                        "stages (contiguous nodes or devices, cut by throughput), or 1 (the SPMD plan only). "
                        "Default: auto when no SPMD plan fits, and on a cluster of several nodes unless --ratios or "
                        "--data-parallel fix an SPMD plan; the faster shape is kept, both are printed")
    p.add_argument("--micro-batches", type=int, help="micro-batches of the pipeline (default: the fastest of S, 2S, 4S)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "eager_1f1b"],
                   help="pipeline schedule (default: the one predicted fastest)")
    p.add_argument("--no-cache", action="store_true",
                   help="plan again instead of returning the plan cached for the same inputs "
                        "($HETSYNTH_CACHE_DIR or ~/.cache/hetsynth/plans; hetsynth.plan_cache)")


def parse_expert_loads(text: str) -> list[float] | dict[str, list[float]]:
    """--expert-loads: numbers separated by commas, or a JSON file holding a list of numbers or
    {op name or module path: list of numbers} (checked against the model by
    instruction_set.experts_op.with_expert_loads)."""
    path = Path(text)
    if path.is_file():
        try:
            value = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"--expert-loads {text}: not a readable JSON file ({err})") from None
        if isinstance(value, list) or (isinstance(value, dict) and all(isinstance(v, list) for v in value.values())):
            return value
        raise ValueError(f"--expert-loads {text}: the file holds {type(value).__name__}; give a list of numbers "
                         "or an object mapping MoE op names or module paths to lists of numbers")
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"--expert-loads {text!r}: neither a file nor numbers separated by commas "
                         "(e.g. 0.4,0.2,0.2,0.2)") from None


def _stages_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 'auto' or a number of stages like 2") from None


def pipeline_summary(plan: "Plan") -> str:
    from hetsynth.planner.stage_dp import stage_memory

    p = plan.pipeline
    stages = "; ".join(f"stage {s.index}: ranks {s.ranks[0]}-{s.ranks[-1]}, calls {s.calls[0]}-{s.calls[1] - 1}"
                       for s in p.stages)
    lines = [f"pipeline: {len(p.stages)} stages, {p.schedule.value}, {len(p.micro_batches)} micro-batches "
             f"{list(p.micro_batches)}: predicted {p.predicted.step_time_s * 1e3:.2f} ms/step "
             f"(schedules: {', '.join(f'{k} {v * 1e3:.2f}' for k, v in p.predicted.schedules.items())})",
             f"  {stages}",
             "  memory: " + ", ".join(f"stage {i} {peak:.2f} of {cap:.1f} GiB ({n} in flight)"
                                      for i, (peak, cap, n) in enumerate(stage_memory(plan))),
             f"best SPMD plan: predicted {plan.predicted.step_time_s * 1e3:.2f} ms/step"
             f"{'' if plan.predicted.fits else ' (does not fit)'}",
             f"chosen: {plan.shape.value}"]
    return "\n".join(lines + ([f"  one micro-batch: {p.coupled}"] if p.coupled else []))


def _parse_ratios(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--ratios {text!r}: expected comma-separated numbers like 0.7,0.3") from None


def plan_run(args: argparse.Namespace) -> int:
    loads_file = args.expert_loads if args.expert_loads and Path(args.expert_loads).is_file() else None
    check_outputs({"-o": args.output},  # before the synthesis it would throw away
                  inputs={"--cluster": args.cluster, "--model": model_file(args.model),
                          **({"--expert-loads": loads_file} if loads_file else {})})
    args.expert_loads = parse_expert_loads(args.expert_loads) if args.expert_loads is not None else None
    if args.stages not in (None, 1) and args.zero not in ("auto", "0"):
        raise ValueError(f"--zero {args.zero} with --stages {args.stages}: the pipeline runtime keeps every stage's "
                         f"training state whole; use --zero auto (the SPMD plan may still use ZeRO) or drop --stages")
    started = time.perf_counter()
    key = plan_cache.cli_key(args)
    cached = plan_cache.lookup(key, parse=False) if key is not None else None
    if cached is not None and cached.summary is not None and not args.json:
        write_atomic(args.output, cached.text)  # what save_plan wrote when it was planned
        print(cached.summary)
        print(f"(cached plan from {cached.created}; --no-cache plans again)")
        print(f"\nwrote {args.output}")
        return 0
    if cached is not None:
        cached = plan_cache.with_plan(cached)  # --json, or an entry the API stored: the plan itself is needed
    return _plan_and_print(args, key, cached, started)


def _plan_and_print(args: argparse.Namespace, key: "plan_cache.CacheKey | None", cached: "plan_cache.Cached | None",
                    started: float) -> int:
    import hetsynth
    from hetsynth.report import instruction_mix

    if cached is not None and cached.plan is not None:
        plan = cached.plan
    else:
        cached = None
        plan = hetsynth.plan(args.model, cluster=args.cluster, batch_size=args.batch_size,
                             num_devices=args.devices, ratios=_parse_ratios(args.ratios),
                             allow_replicate_fallback=args.allow_replicate_fallback, progress=True,
                             measure_ops=args.measure_ops, data_parallel=args.data_parallel,
                             bucket_mb=args.bucket_mb, fusion=not args.no_fusion, zero=args.zero,
                             precision=args.precision, reduce_dtype=args.reduce_dtype,
                             expert_loads=args.expert_loads, stages=args.stages,
                             micro_batches=args.micro_batches, schedule=args.schedule)
        if key is not None:
            plan_cache.store(key, plan, plan_cache.model_files(args.model), summary=_plan_summary(plan))
    hetsynth.save_plan(plan, args.output)
    if args.json:
        _print_json({"plan": args.output, "predicted": plan.predicted.model_dump(),
                     "baselines": {k: v.model_dump() for k, v in plan.baselines.items()},
                     "sharding_ratios": plan.sharding_ratios, "instruction_mix": instruction_mix(plan),
                     "precision": plan.precision_policy().model_dump(mode="json"),
                     "synthesis": plan.synthesis.model_dump(), "cached": cached.created if cached else None})
    else:
        print(_plan_summary(plan))
        if cached is None:  # on stderr: a cache hit prints the same stdout
            log.info("planning time%s: %.1f s", " (SPMD and pipeline)" if plan.pipeline is not None else "",
                     time.perf_counter() - started)
        if cached is not None:
            print(f"(cached plan from {cached.created}; --no-cache plans again)")
        print(f"\nwrote {args.output}")
    return 0


def _plan_summary(plan: "Plan") -> str:
    """What `hetsynth plan` prints of a plan (the plan cache keeps it: a hit prints it again)."""
    from hetsynth.report import plan_summary_text

    lines = [plan_summary_text(plan)]
    if plan.pipeline is not None:
        lines.append("\n" + pipeline_summary(plan))
    return "\n".join(lines)


def run_args(p: argparse.ArgumentParser) -> None:
    """train with a plan: torchrun here, or the per-node torchrun commands"""
    p.add_argument("plan", help="plan file written by hetsynth plan")
    p.add_argument("--model", help="build the model from this reference (path/file.py:factory, gpt:tiny, ...) "
                                   "instead of the plan's own, e.g. for a plan made from a module (hetsynth.plan("
                                   "module, ...) records its class name); it must capture to the plan's graph")
    add_train_arguments(p, skip=("dtype",))  # --check runs the float64 twin itself
    p.add_argument("--devices", type=int, help="run on the first N devices (plans again for them)")
    p.add_argument("--check", action="store_true",
                   help="also run the plan's float64 twin and train the single-device model; compare losses, "
                        "parameters and buffers (float64 decides, the plan's own dtype is information)")
    p.add_argument("--tolerance", type=float, default=1e-9,
                   help="for --check in float64: relative loss; parameters and buffers 10x that")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a rank may make no progress (a collective that does not complete, no "
                        "heartbeat) before the run stops, naming it")
    p.add_argument("--save", help="write a checkpoint at the end (it holds the steps trained: --steps)")
    p.add_argument("--resume", help="continue from a checkpoint (any plan's) up to --steps, which must be "
                                    "more than the checkpoint's step")
    p.add_argument("--report", help="write the run's JSON report here")
    p.add_argument("--trace", help="time every instruction of the last --trace-steps steps on every rank and write "
                                   "them as one Chrome trace here, and predicted vs measured seconds per "
                                   "instruction beside it (X.instructions.json)")
    p.add_argument("--trace-steps", type=int, default=1, help="steps traced with --trace (after the others)")
    p.add_argument("--memory-report", action="store_true",
                   help="measure on every rank the bytes of parameters, gradients and optimizer state it holds "
                        "and the peak bytes of tensors saved for backward (second step), and print them beside "
                        "the plan's prediction")


def run_run(args: argparse.Namespace) -> int:
    import hetsynth
    from hetsynth.instruction_set.plan import load_plan
    from hetsynth.view_commands import raw_trace_dir, trace_outputs, write_run_trace
    from hetsynth.planner.model_check import check_model_unchanged
    from hetsynth.runtime.launch import RunOptions, preflight, run, runs_here

    plan, path = load_plan(args.plan), args.plan
    if args.model is None:
        check_model_resolves(plan)
    check_outputs({"--save": args.save, "--report": args.report, **trace_outputs(args.trace)},
                  inputs={"PLAN": args.plan, "--resume": args.resume,
                          "--model" if args.model else "the plan's model": model_file(args.model or plan.model.ref)})
    if args.trace and not runs_here(plan.cluster):
        raise ValueError(f"--trace {args.trace!r}: cluster {plan.cluster.name!r} has {len(plan.cluster.nodes)} nodes "
                         f"and no emulation section, so its ranks run elsewhere; --trace needs a run on this machine")
    with raw_trace_dir(args.trace) as raw:
        opts = RunOptions(train=train_config(args), timeout_s=args.timeout,
                          check=args.check, tolerance=args.tolerance, save=args.save, resume=args.resume,
                          report=args.report, trace_raw=raw, trace_steps=args.trace_steps,
                          memory_report=args.memory_report)
        preflight(plan, opts)  # output paths and checkpoint, before any planning or training
        if args.devices is not None and args.devices != plan.cluster.num_devices:
            ref = args.model or plan.model.ref
            plan, path = hetsynth.plan(ref, cluster=plan.cluster.first(args.devices),
                                       precision=plan.precision_policy().precision.value,
                                       reduce_dtype=plan.precision_policy().reduce_dtype,
                                       stages=1 if plan.pipeline is None else None), None  # preflight checked this shape
            print(f"planned {plan.model.ref} again for the first {args.devices} devices")
        elif args.model is not None:  # the plan with --model as its reference, written in the run's directory
            plan, path = with_model_ref(plan, args.model), None
        else:  # a plan made earlier: its model must still be the model it was made for
            check_model_unchanged(plan)
        rc = show_run(run(plan, path, opts))
        if raw is not None and len(list(Path(raw).glob("rank*.json"))) == plan.cluster.num_devices:
            write_run_trace(plan, raw, args.trace)  # every rank trained (also when --check then failed)
    return rc


def check_model_resolves(plan: "Plan") -> None:
    """ValueError, before any rank starts, when the plan's model is a module's class name (a
    plan made by hetsynth.plan(module, ...)) rather than a model reference the ranks can build."""
    from hetsynth.instruction_set.models import ModelRefError, parse_model_ref

    try:
        parse_model_ref(plan.model.ref)
    except ModelRefError:
        if not plan.model.ref.isidentifier():  # a reference that no longer resolves says why itself
            raise
        raise ValueError(f"the plan's model {plan.model.ref!r} is not a model reference (the plan was made from a "
                         f"module); give --model file.py:factory that builds it, or train it in your own script "
                         f"with hetsynth.parallelize (hetsynth launch)") from None


def with_model_ref(plan: "Plan", ref: str) -> "Plan":
    """`plan` with its model reference replaced by `ref` (run --model), which must capture to
    the graph the plan was made for (planner.model_check: ModelChangedError naming the first
    difference otherwise)."""
    from hetsynth.instruction_set.models import parse_model_ref
    from hetsynth.planner.capture import capture_spec
    from hetsynth.planner.model_check import ModelChangedError, first_difference

    graph = capture_spec(parse_model_ref(ref), allow_replicate_fallback=bool(plan.graph.fallback_ops))
    if graph.fingerprint != plan.model.fingerprint:
        raise ModelChangedError(f"--model {ref}: not the model the plan was made for ({plan.model.ref!r}): "
                                f"{first_difference(plan.graph, graph)}")
    return plan.model_copy(update={"model": plan.model.model_copy(update={"ref": ref}),
                                   "graph": plan.graph.model_copy(update={"model_ref": ref})})


def show_run(result: "RunResult", command: str = "run") -> int:
    """Print what `runtime.launch.run` (or run_script, for `command` launch) did; its exit status."""
    if result.node_commands is not None:
        print(result.node_commands)
    if result.failure is not None:
        print(f"hetsynth {command}: {result.failure}", file=sys.stderr)
    for r in result.comparisons[:-1]:
        print(f"check (information) {r.describe()}: {'within' if r.ok else 'beyond'} {r.judged} tolerance")
    if result.checked is not None and result.failure is None:
        print(f"check: {result.checked.describe()}: {'OK' if result.checked.ok else 'FAILED'}")
    return result.rc


LAUNCH_TIMEOUT_S = 60.0  # hetsynth run's default


def launch_args(p: argparse.ArgumentParser) -> None:
    """run your own training script on every rank of a plan's cluster (torchrun; on the emulated cluster when
    the spec has one); each rank finds the plan file's absolute path in HETSYNTH_PLAN"""
    p.add_argument("plan", help="plan file (hetsynth plan, or hetsynth.save_plan)")
    p.add_argument("script", help="the Python script every rank runs, as `python SCRIPT ARGS`")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="the script's arguments, passed through untouched (--flags included)")
    p.add_argument("--timeout", type=float,
                   help="seconds a rank may go without a heartbeat (stopped, frozen) before the run stops, naming "
                        "it (default 60), and the collective timeout of the process group hetsynth.parallelize "
                        "creates (HETSYNTH_TIMEOUT; default: parallelize's own); give it before PLAN")


def launch_run(args: argparse.Namespace) -> int:
    from hetsynth.instruction_set.plan import load_plan
    from hetsynth.runtime.launch import run_script

    script = Path(args.script)
    if not script.is_file():
        why = "is a directory" if script.is_dir() else "does not exist"
        raise ValueError(f"script {args.script!r} {why}; give the Python file every rank runs")
    plan = load_plan(args.plan)
    # the ranks' process groups are the script's (hetsynth.parallelize reads HETSYNTH_TIMEOUT)
    env = {"HETSYNTH_TIMEOUT": str(args.timeout)} if args.timeout is not None else {}
    result = run_script(plan, args.plan, args.script, args.script_args, env=env,
                        timeout_s=args.timeout if args.timeout is not None else LAUNCH_TIMEOUT_S)
    return show_run(result, "launch")


def explain_args(p: argparse.ArgumentParser) -> None:
    """print one rank's generated program and shard table"""
    p.add_argument("plan", help="plan file (hetsynth plan's output)")
    p.add_argument("--rank", type=int, default=0, help="the rank whose program is shown")


def explain_run(args: argparse.Namespace) -> int:
    from hetsynth.instruction_set.plan import load_plan
    from hetsynth.explain import explain
    from hetsynth.explain_pipeline import explain_pipeline

    plan = load_plan(args.plan)
    print(explain_pipeline(plan, args.rank) if plan.pipeline is not None else explain(plan, args.rank))
    return 0


def profile_args(p: argparse.ArgumentParser) -> None:
    """measure device throughput and collective alpha-beta; write a measured spec"""
    p.add_argument("--cluster", required=True, help="cluster spec to measure (.toml or .json); its devices run here")
    p.add_argument("-o", "--output", default="measured.toml", help="where to write the measured spec")
    p.add_argument("--seconds", type=float, default=1.0, help="time spent on each compute measurement")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each collective measurement")
    p.add_argument("--max-bytes", type=int, default=16 * 2**20, help="largest message measured")
    p.add_argument("--records", help="also write every collective measurement (JSON) to this file")


def profile_run(args: argparse.Namespace) -> int:
    import os

    from hetsynth.instruction_set.cluster import load_cluster
    from hetsynth.instruction_set.matmul_rates import Dtype
    from hetsynth.profiling.matmul_dtypes import unsupported_claims
    from hetsynth.runtime.launch import launch_checked

    cluster = load_cluster(args.cluster)
    outputs = check_outputs({"-o": args.output, "--records": args.records}, inputs={"--cluster": args.cluster})
    output = str(outputs["-o"])
    launch_checked(cluster, ["-m", "hetsynth.profiling.profile_worker", "--cluster", os.path.abspath(args.cluster),
                             "--output", output, "--seconds", str(args.seconds), "--reps", str(args.reps),
                             "--max-bytes", str(args.max_bytes),
                             *(["--records", os.path.abspath(args.records)] if args.records else [])],
                   "profiling")
    measured = load_cluster(output)
    for name, kind in measured.device_kinds.items():
        rates = ", ".join(f"{d.value} {kind.rate_flops(d) / 1e9:.2f}" for d in Dtype if kind.rate_flops(d) is not None)
        print(f"  {name:24s} matmul GFLOP/s: {rates}")
    for line in unsupported_claims(cluster, measured):
        print(f"warning: {line}")
    for name, per_class in (measured.calibration.collectives if measured.calibration else {}).items():
        line = ", ".join(f"{c}: {ab.latency_us:.0f} us, {ab.bandwidth_gbps:.3f} Gbit/s" for c, ab in per_class.items())
        print(f"  {name:24s} {line}")
    print(f"wrote {output}")
    return 0


def demo_args(p: argparse.ArgumentParser) -> None:
    """the README demo: plan a model for the local emulated cluster, run it and DP-EV there"""
    p.add_argument("--model", default="gpt:small-cpu", help="model reference to plan and train")
    p.add_argument("--cluster", default="configs/clusters/local-emulated.toml", help="cluster spec (emulated here)")
    p.add_argument("--profile", action="store_true", help="measure the cluster again first")
    p.add_argument("--warmup", type=int, default=2, help="steps of each plan before timing")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of 2 steps of each plan")
    p.add_argument("--tolerance", type=float, default=1e-4, help="relative loss difference (float32)")
    p.add_argument("--out", default="demo-output", help="directory for the plan, its traces and its HTML report")


def demo_run(args: argparse.Namespace) -> int:
    from hetsynth.demo import run_demo

    return run_demo(args)


def cleanup_args(p: argparse.ArgumentParser) -> None:
    """remove what dead runs left behind: processes, network namespaces, veths, cgroups, temp directories
    (a record naming anything hetsynth did not make is set aside untouched, with a note)"""
    p.add_argument("--unrecorded", action="store_true",
                   help="also remove emulated clusters that no run recorded and whose process is gone "
                        "(left by hetsynth versions before run records)")


def cleanup_run(args: argparse.Namespace) -> int:
    from hetsynth.runtime import emulation, runstate

    removed = runstate.remove_dead_runs()
    if args.unrecorded and emulation.unavailable() is None:
        removed += [f"removed unrecorded {what}" for what in emulation.remove_unrecorded()]
    for line in removed or ["nothing left behind by dead runs"]:
        print(f"note: {line}" if line.startswith(runstate.SKIPPED) else line)
    for line in runstate.live_runs():
        print(line)
    return 0


from hetsynth.view_commands import report_args, report_run, trace_args, trace_run  # noqa: E402

COMMANDS = {
    "inspect": (inspect_args, inspect_run),
    "plan": (plan_args, plan_run),
    "run": (run_args, run_run),
    "launch": (launch_args, launch_run),
    "explain": (explain_args, explain_run),
    "profile": (profile_args, profile_run),
    "demo": (demo_args, demo_run),
    "cleanup": (cleanup_args, cleanup_run),
    "trace": (trace_args, trace_run),
    "report": (report_args, report_run),
}
