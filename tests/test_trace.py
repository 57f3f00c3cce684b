"""Predicted and measured Chrome traces, and the HTML report (issue 19).

Every trace validates against the JSON schema of the Trace Event Format (hetsynth.trace
.TRACE_SCHEMA); the predicted trace's per-device lanes add up to the plan's predicted
per-device compute and communication; a traced training step (world size 2, float64) trains
exactly as an untraced one and times every instruction; the report names no external URL and
renders in headless Chromium (skipped where Chromium is missing)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest

from hetsynth.instruction_set.cluster import load_cluster
from hetsynth import capture_model
from hetsynth.cli import main
from hetsynth.measured import comparison, measured_trace
from hetsynth.report_html import report_html
from hetsynth.trace import COMMUNICATION, COMPUTE, GRADIENT_SYNC, SYNC_WAIT, TRACE_SCHEMA, predicted_step, predicted_trace
from hetsynth.instruction_set.plan import Plan, save_plan
from hetsynth.planner.planner import make_plan
from hetsynth.runtime.config import TrainConfig
from hetsynth.runtime.rank_state import assemble
from hetsynth.runtime.train import reference_training

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from render import COMMUNICATION_RGB, COMPUTE_RGB, chromium, dark_pixels, pixels_of, png_pixels, screenshot  # noqa: E402
EMULATED = ROOT / "configs" / "clusters" / "local-emulated.toml"
A100_T4 = ROOT / "configs" / "clusters" / "a100-t4.toml"
MEASURED = ROOT / "bench" / "results" / "local-emulated-measured.toml"  # transfer CPU costs measured


def _plan(ref: str, cluster: Path, ratios: list[float] | None, devices: int) -> Plan:
    spec = load_cluster(cluster).first(devices)
    return make_plan(capture_model(ref), spec, ratios=ratios, progress=False, with_baselines=ratios is not None)


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {"gpt uneven": _plan("gpt:tiny", EMULATED, [0.4, 0.3, 0.2, 0.1], 4),
            "vit searched": _plan("vit:tiny", A100_T4, None, 8),
            "gpt transfer cpu": _plan("gpt:tiny", MEASURED, [0.4, 0.3, 0.2, 0.1], 4),
            "gpt fused": _fused_plan()}


def _fused_plan() -> Plan:
    """Sequence-parallel tensor-parallel MLPs on 2 uneven ranks, every pair fused
    (tests/test_fused_parity.py's forced plan of gpt)."""
    from test_fused_parity import fused_plan

    plan = fused_plan("gpt", [0.55, 0.45])
    assert any(i.kind in ("ag_matmul", "matmul_rs") for i in plan.instructions)
    return plan


def _lane_totals(trace: dict, tid: int, n: int) -> list[float]:
    out = [0.0] * n
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["tid"] == tid:
            out[e["pid"]] += e["dur"] / 1e6
    return out


@pytest.mark.parametrize("name", ["gpt uneven", "vit searched", "gpt transfer cpu", "gpt fused"])
@pytest.mark.slow
def test_predicted_trace_matches_the_plan(plans: dict[str, Plan], name: str) -> None:
    plan = plans[name]
    trace = json.loads(json.dumps(predicted_trace(plan)))
    jsonschema.validate(trace, TRACE_SCHEMA)
    n = plan.cluster.num_devices
    for i, (c, d) in enumerate(zip(_lane_totals(trace, COMPUTE, n), plan.predicted.devices)):
        assert c == pytest.approx(d.compute_s, rel=1e-9), (i, c, d.compute_s)
    for comm in _lane_totals(trace, COMMUNICATION, n):
        assert comm == pytest.approx(plan.predicted.communication_s, rel=1e-9)
    ends = [e["ts"] + e["dur"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert max(ends) / 1e6 == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert len(names) == n
    assert any(e["name"].startswith("wait for") for e in trace["traceEvents"]) == (len(set(plan.sharding_ratios)) > 1
                                                                                  or name == "vit searched")
    charged = any(k.transfer_cpu_share > 0 for k in plan.cluster.device_kinds.values())
    assert any(e["name"].startswith("transfer CPU") for e in trace["traceEvents"]) == charged


@pytest.mark.parametrize("name", ["gpt uneven", "vit searched"])
@pytest.mark.slow
def test_gradient_buckets_overlap_the_backward_in_the_trace(plans: dict[str, Plan], name: str) -> None:
    """Every bucket of the plan is on the gradient sync lane, in order, none before it is ready
    or before the one ahead of it ends; the wait after the backward is what is left of them."""
    plan = plans[name]
    step = predicted_step(plan)
    assert plan.gradient_sync is not None and len(step.buckets) == len(plan.gradient_sync.buckets) > 0
    end = 0.0
    for b in step.buckets:
        assert b.start_s == pytest.approx(max(end, b.ready_s), rel=1e-12)
        end = b.start_s + b.seconds
    start, wait = step.sync_wait
    assert wait == pytest.approx(max(end - start, 0.0), abs=1e-15)
    trace = predicted_trace(plan)
    lane = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == GRADIENT_SYNC and e["pid"] == 0]
    assert [e["name"] for e in lane] == [b.name for b in step.buckets]
    waits = [e for e in trace["traceEvents"] if e.get("name") == SYNC_WAIT and e["pid"] == 0]
    assert len(waits) == (wait > 0.0) and all(e["tid"] == COMMUNICATION for e in waits)


def test_schema_refuses_what_is_not_a_trace() -> None:
    bad = [{"traceEvents": [{"name": "x", "ph": "X", "pid": 0, "tid": 1, "ts": 0, "dur": -1}]},
           {"traceEvents": [{"name": "x", "ph": "X", "pid": 0, "tid": 1}]},
           {"traceEvents": [{"name": "x", "ph": "Q", "pid": 0, "tid": 1, "ts": 0}]},
           {"events": []}]
    for doc in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, TRACE_SCHEMA)


CONFIG = TrainConfig(steps=3, optimizer="adamw", lr=1e-2, max_grad_norm=1.0)


def traced_worker(rank: int, world: int, plan: Plan, config: TrainConfig) -> tuple:
    import torch.distributed as dist
    from hetsynth.runtime.groups import Groups
    from hetsynth.runtime.timing import StepTracer
    from hetsynth.runtime.train import local_parameters, setup, train_step

    trainer = setup(plan, Groups.create(plan.mesh, rank, world=dist.group.WORLD), config)
    tracer = StepTracer(trainer)
    losses = [(tracer.step(s) if s >= 1 else train_step(trainer, s)).loss for s in range(config.steps)]
    return losses, tracer.record(), local_parameters(trainer)


@pytest.fixture(scope="module")
def traced(pools) -> tuple[Plan, list, dict]:
    plan = _plan("gpt:tiny,dtype=float64", EMULATED, [0.7, 0.3], 2)
    results = pools.get(2).run(traced_worker, plan, CONFIG, timeout_s=300)
    return plan, ([r[0] for r in results], assemble(plan, [r[2] for r in results])), \
        measured_trace(plan, [r[1] for r in results])


def test_traced_steps_train_as_untraced(traced) -> None:
    plan, (losses, params), _ = traced
    from hetsynth.instruction_set.models import parse_model_ref

    spec = parse_model_ref(plan.model.ref)
    expected, expected_params = reference_training(spec, spec.batch_size, CONFIG)
    for got, want in zip(losses[0], expected):
        assert abs(got - want) <= 1e-9 * abs(want)
    for name, value in params.items():
        assert float((value - expected_params[name]).abs().max()) <= 1e-8, name


def test_measured_trace_times_every_instruction(traced) -> None:
    plan, _, trace = traced
    jsonschema.validate(json.loads(json.dumps(trace)), TRACE_SCHEMA)
    timed = {(e["pid"], e["args"]["instruction"], e["args"]["pass"], e["args"]["step"])
             for e in trace["traceEvents"] if e["ph"] == "X" and "instruction" in e["args"]}
    wanted = [k for k, i in enumerate(plan.instructions) if i.kind == "compute"
              or (i.kind in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all") and i.phase == "forward")]
    for rank in range(2):
        for step in (2, 3):  # 1-based: the last two of three steps
            assert {k for k in wanted if (rank, k, "forward", step) not in timed} == set()
    backward = {k for (_, k, p, _) in timed if p == "backward"}
    assert len(backward) > len(wanted) // 2  # most instructions have a backward
    result = comparison(plan, trace)
    assert result["traced_steps"] == [2, 3] and result["step"]["measured_s"] > 0
    assert all(r["measured_s"] > 0 for r in result["instructions"] if r["instruction"] in wanted)
    assert {g["name"] for g in result["bulk"]} == {"gradient sync", "update and step all-reduces"}


def _forbidden_references(html: str) -> list[str]:
    return re.findall(r"(?i)(?:https?:|ftp:|file:|//[a-z0-9.-]+\.[a-z]{2,}|\bsrc\s*=|\bhref\s*=|@import|url\()", html)


def test_report_is_self_contained(traced, tmp_path: Path) -> None:
    plan, _, trace = traced
    html = report_html(plan, trace, comparison(plan, trace))
    assert _forbidden_references(html) == []
    assert _forbidden_references('<img src="x.png"> https://cdn.example.org/x.js') != []  # the check can fail
    assert html.count('class="timeline"') == 2 and html.count("<table") >= 8
    for section in ("Cluster", "Sharding ratios", "Memory per device", "baselines", "Instruction mix",
                    "Timeline", "differ most"):
        assert section in html


@pytest.mark.skipif(chromium() is None, reason="no Chromium on this machine (apt-get install chromium)")
def test_report_renders_in_headless_chromium(traced, tmp_path: Path) -> None:
    plan, _, trace = traced
    page, shot = tmp_path / "report.html", tmp_path / "report.png"
    page.write_text(report_html(plan, trace, comparison(plan, trace)))
    screenshot(page, shot)
    pixels = png_pixels(shot)
    assert pixels_of(pixels, COMPUTE_RGB) > 200 and pixels_of(pixels, COMMUNICATION_RGB) > 200  # the timelines
    assert dark_pixels(pixels) > 5000  # text of the tables


def test_cli_trace_and_report(plans: dict[str, Plan], traced, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = plans["gpt uneven"]
    save_plan(plan, tmp_path / "plan.json")
    assert main(["trace", str(tmp_path / "plan.json"), "-o", str(tmp_path / "p.json")]) == 0
    jsonschema.validate(json.loads((tmp_path / "p.json").read_text()), TRACE_SCHEMA)
    assert main(["report", str(tmp_path / "plan.json"), "-o", str(tmp_path / "r.html")]) == 0
    assert "<svg" in (tmp_path / "r.html").read_text()
    traced_plan, _, trace = traced
    save_plan(traced_plan, tmp_path / "traced.json")
    (tmp_path / "m.json").write_text(json.dumps(trace))
    assert main(["report", str(tmp_path / "traced.json"), "--measured", str(tmp_path / "m.json"),
                 "-o", str(tmp_path / "rm.html")]) == 0
    assert "differ most" in (tmp_path / "rm.html").read_text()
    # another plan's trace is refused, naming the file
    assert main(["report", str(tmp_path / "plan.json"), "--measured", str(tmp_path / "m.json"),
                 "-o", str(tmp_path / "x.html")]) == 2
    assert "a trace of another plan" in capsys.readouterr().err and not (tmp_path / "x.html").exists()


def test_fused_instructions_in_the_trace_and_the_comparison(plans: dict[str, Plan], pools) -> None:
    """A fused instruction is laid out as its matmuls (compute lane) and its exposed transfer
    (communication lane), forward and backward; a traced run of the plan compares it in one
    row: the sum of its pieces against its measured forward and backward."""
    plan = plans["gpt fused"]
    step = predicted_step(plan)
    fused = [k for k, i in enumerate(plan.instructions) if i.kind in ("ag_matmul", "matmul_rs")]
    for k in fused:
        pieces = [t for t in step.instructions if t.index == k]
        assert {t.args["pass"] for t in pieces} == {"forward", "backward"}
        assert any(t.lane == COMPUTE for t in pieces)
        placed = [p for p in step.placed if p.times.index == k]
        assert len(placed) == len(pieces) and all(p.share == 1.0 for p in placed)
    results = pools.get(2).run(traced_worker, plan, CONFIG, timeout_s=300)
    result = comparison(plan, measured_trace(plan, [r[1] for r in results]))
    rows = {r["instruction"]: r for r in result["instructions"]}
    assert len(rows) == len(result["instructions"])
    for k in fused:
        want = sum(t.step_s for t in step.instructions if t.index == k)
        assert rows[k]["predicted_s"] == pytest.approx(want, rel=1e-12) and rows[k]["measured_s"] > 0
        assert rows[k]["lane"] == "communication"
