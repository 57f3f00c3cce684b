"""Subcommands that show a plan: `trace` (the predicted step as a Chrome trace) and `report`
(one self-contained HTML page), and the `--trace` of `run` (hetsynth.measured)."""

from __future__ import annotations

import argparse
import json
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from hetsynth.instruction_set.files import write_atomic
from hetsynth.runtime.outputs import check_outputs


def trace_args(p: argparse.ArgumentParser) -> None:
    """write the predicted step of a plan as a Chrome trace (Perfetto, chrome://tracing)"""
    p.add_argument("plan", help="plan file written by hetsynth plan")
    p.add_argument("-o", "--output", default="predicted.json", help="where to write the trace")


def trace_run(args: argparse.Namespace) -> int:
    from hetsynth.trace import predicted_trace
    from hetsynth.instruction_set.plan import PlanShape, load_plan

    output = check_outputs({"-o": args.output}, inputs={"PLAN": args.plan})["-o"]
    plan = load_plan(args.plan)
    if plan.shape is PlanShape.PIPELINE:
        return _pipeline_trace_run(plan, output)
    trace = predicted_trace(plan)
    write_atomic(output, json.dumps(trace))
    slices = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
    print(f"wrote {args.output}: {slices} slices on {plan.cluster.num_devices} devices, predicted step "
          f"{plan.predicted.step_time_s * 1e3:.3f} ms (open it in Perfetto or chrome://tracing)")
    return 0


def _pipeline_trace_run(plan, output: Path) -> int:
    from hetsynth.report_pipeline import pipeline_trace

    trace = pipeline_trace(plan)
    write_atomic(output, json.dumps(trace))
    slices = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
    print(f"wrote {output}: {slices} slices on {len(plan.pipeline.stages)} stages, predicted step "
          f"{plan.pipeline.predicted.step_time_s * 1e3:.3f} ms ({plan.pipeline.schedule.value}; open it in Perfetto "
          f"or chrome://tracing)")
    return 0


def report_args(p: argparse.ArgumentParser) -> None:
    """write one self-contained HTML page about a plan (and a measured trace of it)"""
    p.add_argument("plan", help="plan file written by hetsynth plan")
    p.add_argument("--measured", help="a trace `hetsynth run PLAN --trace FILE` wrote for this plan")
    p.add_argument("-o", "--output", default="report.html", help="where to write the page")


def report_run(args: argparse.Namespace) -> int:
    from hetsynth.measured import comparison, load_measured
    from hetsynth.report_html import report_html
    from hetsynth.instruction_set.plan import PlanShape, load_plan

    output = check_outputs({"-o": args.output}, inputs={"PLAN": args.plan, "--measured": args.measured})["-o"]
    plan = load_plan(args.plan)
    if args.measured and plan.shape is PlanShape.PIPELINE:
        raise ValueError(f"--measured {args.measured}: pipeline plans have no measured traces yet (`run --trace` "
                         f"refuses them); report the plan without --measured")
    measured = load_measured(args.measured, plan) if args.measured else None
    page = report_html(plan, measured, comparison(plan, measured) if measured else None)
    write_atomic(output, page)
    print(f"wrote {output} ({len(page) / 1024:.0f} KiB)")
    return 0


def trace_outputs(trace: str | None) -> dict[str, str | Path | None]:
    """The output paths `run --trace` writes (checked with the run's other outputs)."""
    from hetsynth.measured import companion_path

    return {"--trace": trace, "--trace (comparison)": companion_path(trace) if trace else None}


@contextmanager
def raw_trace_dir(trace: str | None) -> Iterator[str | None]:
    """A directory for the ranks' raw records while the run lasts (None without --trace)."""
    if trace is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="hetsynth-trace-") as tmp:
        Path(tmp).chmod(0o777)  # ranks of an emulated cluster may run as another user
        yield tmp


def write_run_trace(plan, raw_dir: str, trace: str) -> None:
    """Merge the ranks' records into `trace` and its comparison; print a summary."""
    from hetsynth.measured import companion_path, write_measured

    result = write_measured(plan, raw_dir, trace)
    step = result["step"]
    print(f"wrote {trace} (steps {result['traced_steps']}, measured step {step['measured_s'] * 1e3:.1f} ms, "
          f"predicted {step['predicted_s'] * 1e3:.1f} ms) and {companion_path(trace)}")
