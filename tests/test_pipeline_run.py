"""A pipeline plan under the CLI: `hetsynth run --check` matches single-device training in
float64 and its `--save` checkpoint resumes under an SPMD plan, a killed rank of either stage stops the run with that rank named, `hetsynth explain
--rank` shows the stage and its action list; and on the shipped local-emulated cluster, where
SPMD is predicted faster, `plan_stages` keeps the SPMD shape. Two ranks on one node, no
emulation (torchrun on this machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetsynth import capture_model, save_plan
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.instruction_set.plan import PlanShape
from hetsynth.planner.pipeline import block_starts, make_pipeline_plan, plan_stages
from hetsynth.planner.planner import make_plan

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = load_cluster(ROOT / "configs" / "clusters" / "local-emulated.toml")


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    cluster = CLUSTER.first(2).model_copy(update={"emulation": None})
    graph = capture_model("gpt:tiny")
    spmd = make_plan(graph, cluster, ratios=[1.0, 1.0], width=8, progress=False, with_baselines=False)
    cut, n = block_starts(graph)[1], len(graph.calls)
    plan = make_pipeline_plan(spmd, parse_model_ref("gpt:tiny"), [(range(0, 1), (0, cut)), (range(1, 2), (cut, n))],
                              num_micro=3, width=8)
    path = tmp_path_factory.mktemp("pipeline") / "plan.json"
    save_plan(plan, path)
    save_plan(spmd, path.with_name("spmd.json"))
    return str(path)


def hetsynth(*args: str, env: dict | None = None, timeout: float = 200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetsynth", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env=os.environ | (env or {}))


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_run_check_matches_single_device_and_resumes_under_spmd(plan_path: str) -> None:
    """The pipeline's checkpoint (`--save`) resumes under an SPMD plan of the same devices, and
    the resumed run matches single-device training resumed from it."""
    ckpt = str(Path(plan_path).with_name("ckpt.pt"))
    out = hetsynth("run", plan_path, "--steps", "2", "--check", "--save", ckpt)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "check: float64" in out.stdout and "OK" in out.stdout, out.stdout[-2000:]
    spmd = str(Path(plan_path).with_name("spmd.json"))
    out = hetsynth("run", spmd, "--steps", "3", "--check", "--resume", ckpt)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stderr + out.stdout and "OK" in out.stdout, out.stdout[-2000:]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.slow
def test_dead_rank_in_a_stage_is_named(plan_path: str, rank: int) -> None:
    """A rank killed in either stage (rank 0: the first, which sends; rank 1: the last, which
    computes the loss) stops the whole run, the dead rank named."""
    out = hetsynth("run", plan_path, "--steps", "5", "--timeout", "10", env={"HETSYNTH_FAULT": f"{rank}:1:kill"})
    assert out.returncode != 0
    assert f"hetsynth run: rank {rank} failed: killed by SIGKILL" in out.stderr, out.stderr[-3000:]


@pytest.mark.slow
def test_explain_shows_the_stage_and_its_actions(plan_path: str) -> None:
    out = hetsynth("explain", plan_path, "--rank", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rank 1: stage 1 of 2" in out.stdout and "micro-batches [3, 3, 2]" in out.stdout
    assert "receives" in out.stdout and "  0 RECV_F mb 0 boundary 0" in out.stdout


@pytest.mark.slow
def test_spmd_stays_where_it_is_faster() -> None:
    spmd = make_plan(capture_model("gpt:tiny"), CLUSTER, width=8, progress=False, with_baselines=False)
    plan = plan_stages(spmd, parse_model_ref("gpt:tiny"), 2, width=8)
    assert plan.pipeline is not None and plan.shape is PlanShape.SPMD
    assert plan.pipeline.predicted.step_time_s >= spmd.predicted.step_time_s * 0.98


@pytest.mark.slow
def test_options_pipelines_lack_are_refused_before_any_rank_starts(plan_path: str) -> None:
    out = hetsynth("run", plan_path, "--steps", "2", "--memory-report")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith("error: --memory-report: not available for pipeline plans yet"), out.stderr[-2000:]


@pytest.mark.slow
def test_report_draws_the_stages_and_the_recorded_timeline(plan_path: str, tmp_path: Path, capsys) -> None:
    """The plan records the chosen schedule's simulated step (every F and B of every stage and
    micro-batch, the transfers, ending by the predicted step time); `hetsynth report` draws it
    with the stages and boundaries, and refuses a measured trace it cannot have; `hetsynth
    trace` writes it as a Chrome trace."""
    from hetsynth.cli import main
    from hetsynth.instruction_set.plan import load_plan

    pipeline = load_plan(plan_path).pipeline
    events = pipeline.predicted.timeline
    want = {(s, k, m) for s in range(2) for k in "FB" for m in range(3)}
    assert {(e.stage, e.kind, e.micro_batch) for e in events if e.kind in "FB"} == want
    assert {e.kind for e in events} >= {"XFER_F", "XFER_B"}
    assert max(e.end_s for e in events) <= pipeline.predicted.step_time_s + 1e-12
    page = tmp_path / "report.html"
    assert main(["report", plan_path, "-o", str(page)]) == 0
    html = page.read_text()
    assert "Pipeline: 2 stages" in html and "Boundaries (cross-mesh resharding)" in html
    assert html.count("<rect") == len(events) and "http" not in html
    assert main(["report", plan_path, "--measured", plan_path, "-o", str(page)]) == 2
    assert "error: --measured" in capsys.readouterr().err
    trace = tmp_path / "trace.json"
    assert main(["trace", plan_path, "-o", str(trace)]) == 0  # the same timeline for Perfetto
    slices = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == len(events) and {e["pid"] for e in slices} == {0, 1}
