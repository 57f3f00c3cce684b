"""A run trains the model it was planned for, on the user's data, and stops at a non-finite
step (issue 36, integrity; issue 37, a factory's inputs):

- a model changed after planning is refused before any rank starts, naming the first difference;
- a loss or gradient norm that is NaN or infinite stops SPMD and pipeline training at that
  step on every rank (NonFiniteError naming the step); `hetsynth run` exits 1 naming it;
- a `file.py:factory` whose example inputs are written without `device=` trains on those rows
  (building the module on the meta device never turns them into meta tensors and random rows).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

import hetsynth
from hetsynth import capture_model
from hetsynth.cli import main
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.instruction_set.plan import Plan
from hetsynth.planner.model_check import ModelChangedError, check_model_unchanged
from hetsynth.planner.planner import make_plan
from hetsynth.runtime.config import TrainConfig
from hetsynth.runtime.train import ModelMismatchError, NonFiniteError, check_finite, check_state, initial_state

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "configs" / "clusters" / "local-emulated.toml"

TOKENS = """
import torch
class LM(torch.nn.Module):
    def __init__(self, vocab=16, width=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.out = torch.nn.Linear(width, vocab)
    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.out(torch.ACT(self.emb(x))).flatten(0, 1), y.flatten())
def model(**kw):
    x = torch.randint(0, 16, (4, 6))  # no device=: a meta context would make these meta tensors
    return LM(), (x, (x + 1) % 16)
"""


def _model_file(tmp: Path, act: str = "tanh") -> str:
    path = tmp / "lm.py"
    path.write_text(TOKENS.replace("ACT", act))
    return f"{path}:model"


def _factory_rows(ref: str, seed: int) -> tuple[torch.Tensor, ...]:
    """The inputs the factory writes when the module is built under `seed` (as every rank and
    the single-device reference build it)."""
    torch.manual_seed(seed)
    fresh = parse_model_ref(ref)  # nothing cached
    fresh.build("cpu")
    return fresh.example_inputs("cpu")


def test_factory_inputs_without_device_are_the_training_rows(tmp_path: Path) -> None:
    """Building on the meta device (capture, checkpoints) before and after the CPU build does
    not replace the factory's inputs: the training rows are its rows (sample i is row i % 4)."""
    ref = _model_file(tmp_path)
    spec = parse_model_ref(ref)
    spec.build("meta")
    state, params = initial_state(spec, seed=0)
    spec.build("meta")
    assert params == {"emb.weight", "out.weight", "out.bias"} and set(state) == params
    want = _factory_rows(ref, seed=0)
    got = spec.make_batch(range(6), seed=1)
    assert all(g.device.type == "cpu" for g in got)
    for g, w in zip(got, want):
        assert torch.equal(g, w[[i % 4 for i in range(6)]])


def test_factory_inputs_for_capture_are_its_shapes(tmp_path: Path) -> None:
    """A spec whose module was only built on the meta device still captures with the factory's
    input shapes and dtypes."""
    spec = parse_model_ref(_model_file(tmp_path))
    spec.build("meta")
    inputs = spec.example_inputs("meta")
    assert [(tuple(t.shape), t.dtype) for t in inputs] == [((4, 6), torch.int64)] * 2
    assert spec.batch_size == 4


@pytest.mark.slow
def test_changed_model_is_refused_naming_the_difference(tmp_path: Path) -> None:
    ref = _model_file(tmp_path)
    plan = hetsynth.plan(ref, cluster=str(CLUSTER), num_devices=2, ratios=[0.5, 0.5])
    check_model_unchanged(plan)  # the same model: no error
    _model_file(tmp_path, act="relu")
    with pytest.raises(ModelChangedError, match=r"aten\.tanh\.default.*tanh.default in the plan, "
                                                r"aten\.relu\.default now; make a new plan"):
        check_model_unchanged(plan)
    (tmp_path / "lm.py").write_text(TOKENS.replace("ACT", "tanh").replace("width=8", "width=12"))
    with pytest.raises(ModelChangedError, match=r"param 'emb.weight': outputs \(16, 8\) float32 in the plan, "
                                                r"\(16, 12\) float32 now"):
        check_model_unchanged(plan)


def test_ranks_refuse_a_model_with_other_parameters(tmp_path: Path) -> None:
    """A rank started by hand (no launcher check) compares the model it builds with the plan's
    parameters before building its program."""
    ref = _model_file(tmp_path)
    plan = hetsynth.plan(ref, cluster=str(CLUSTER), num_devices=2, ratios=[0.5, 0.5])
    check_state(plan, initial_state(parse_model_ref(ref), seed=0)[0])
    (tmp_path / "lm.py").write_text(TOKENS.replace("ACT", "tanh").replace("width=8", "width=12"))
    with pytest.raises(ModelMismatchError, match=r"its param 'emb.weight' is \(16, 12\) float32 here, "
                                                 r"\(16, 8\) float32 in the plan; make a new plan"):
        check_state(plan, initial_state(parse_model_ref(ref), seed=0)[0])
    (tmp_path / "lm.py").write_text(TOKENS.replace("ACT", "tanh").replace("self.out", "self.head"))
    with pytest.raises(ModelMismatchError, match=r"its param 'out.weight' is missing here"):
        check_state(plan, initial_state(parse_model_ref(ref), seed=0)[0])


@pytest.mark.slow
def test_run_refuses_a_changed_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`hetsynth run` stops before any rank starts (exit 2, nothing trained)."""
    ref = _model_file(tmp_path)
    path = tmp_path / "plan.json"
    hetsynth.save_plan(hetsynth.plan(ref, cluster=str(CLUSTER), num_devices=2, ratios=[0.5, 0.5]), path)
    _model_file(tmp_path, act="sigmoid")
    report = tmp_path / "report.json"
    assert main(["run", str(path), "--steps", "1", "--report", str(report)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the planning log, when the CLI shows it
    assert err.startswith("error: model ") and "changed since it was planned" in err and "sigmoid" in err, err
    assert not report.exists()


def test_check_finite_names_the_step_and_the_values() -> None:
    check_finite(0, loss=1.5, gradient_norm=0.0)
    with pytest.raises(NonFiniteError, match=r"^step 3: the loss is nan, the gradient norm is inf; training stopped"):
        check_finite(2, loss=math.nan, gradient_norm=math.inf)


def _spmd_worker(rank: int, world: int, plan: Plan, config: TrainConfig) -> str:
    import torch.distributed as dist
    from hetsynth.runtime.groups import Groups
    from hetsynth.runtime.train import setup, train_step

    trainer = setup(plan, Groups.create(plan.mesh, rank, world=dist.group.WORLD), config)
    return _until_non_finite(lambda step: train_step(trainer, step), config.steps)


def _until_non_finite(train_step: Callable[[int], object], steps: int) -> str:
    """The NonFiniteError's message, or that every step trained."""
    try:
        for step in range(steps):
            train_step(step)
    except NonFiniteError as err:
        return str(err)
    return "trained to the end"


@pytest.mark.parametrize("clip", [1.0, None], ids=["clipped", "unclipped"])
def test_spmd_training_stops_at_a_non_finite_step(pools, clip: float | None) -> None:
    """--lr 1e30: the first update makes the parameters overflow, so step 2's loss is NaN; every
    rank stops there (clipped: before the update, on the gradient norm and the loss)."""
    plan = make_plan(capture_model("gpt:tiny"), load_cluster(CLUSTER).first(2), ratios=[0.6, 0.4],
                     progress=False, with_baselines=False)
    config = TrainConfig(steps=4, lr=1e30, max_grad_norm=clip)
    results = pools.get(2).run(_spmd_worker, plan, config, timeout_s=300)
    want = "step 2: the loss is nan" + (", the gradient norm is nan" if clip else ";")
    assert all(r.startswith(want) for r in results), results


def _pipeline_worker(rank: int, world: int, plan: Plan, config: TrainConfig) -> str:
    import torch.distributed as dist
    from hetsynth.runtime.pipeline.trainer import setup, train_step

    trainer = setup(plan, rank, config, world=dist.group.WORLD)
    return _until_non_finite(lambda step: train_step(trainer, step), config.steps)


def test_pipeline_training_stops_at_a_non_finite_step(pools) -> None:
    from hetsynth.planner.pipeline import block_starts, make_pipeline_plan

    graph = capture_model("gpt:tiny")
    spmd = make_plan(graph, load_cluster(CLUSTER).first(2), ratios=[1.0, 1.0], width=8, progress=False,
                     with_baselines=False)
    cut = block_starts(graph)[len(block_starts(graph)) // 2]
    plan = make_pipeline_plan(spmd, parse_model_ref("gpt:tiny"), [(range(0, 1), (0, cut)),
                                                                  (range(1, 2), (cut, len(graph.calls)))],
                              num_micro=2, width=8)
    results = pools.get(2).run(_pipeline_worker, plan, TrainConfig(steps=3, lr=1e30), timeout_s=300)
    assert all(r.startswith("step 2: the loss is nan, the gradient norm is nan") for r in results), results


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetsynth", *args], capture_output=True, text=True, cwd=ROOT,
                          env=os.environ | {"OMP_NUM_THREADS": "1"}, timeout=600)


@pytest.mark.slow
def test_factory_model_runs_checked_and_stops_on_a_nan_loss(tmp_path: Path) -> None:
    """On two ranks the factory's model matches single-device training (--check, float64 twin:
    the ranks train on the factory's rows, as the reference does); with --lr 1e30 (the loss NaN
    from step 2 or 3) the run exits 1 naming the rank, the error and the first non-finite step."""
    path = tmp_path / "plan.json"
    hetsynth.save_plan(hetsynth.plan(_model_file(tmp_path), cluster=str(CLUSTER), num_devices=2, ratios=[0.5, 0.5]),
                       path)
    out = _cli("run", str(path), "--steps", "2", "--check")
    assert out.returncode == 0 and "check:" in out.stdout and "OK" in out.stdout, out.stdout + out.stderr[-3000:]
    out = _cli("run", str(path), "--steps", "3", "--lr", "1e30")
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    found = re.search(r"failed: NonFiniteError: step (\d): the loss is nan", out.stderr)
    assert found, out.stderr[-3000:]
    assert f"step    {found[1]}/3" not in out.stdout  # the first non-finite step is not logged as trained
