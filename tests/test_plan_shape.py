"""Pipelines considered by default (hetsynth.plan_shape): with no `stages`, `hetsynth.plan` and
`hetsynth plan` return a pipeline wherever `stages="auto"` does on a cluster of several nodes
(slow-pair-emulated: two devices on two nodes, a 50 Mbit/s link between them, where gpt:tiny's
pipeline is predicted faster than its SPMD plan); `stages=1` keeps the SPMD plan only; inputs
that describe an SPMD plan (fixed ratios, data_parallel), one node, and a module get no
pipeline unless asked; bad `stages` and its companions are errors naming the value."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hetsynth
from hetsynth.instruction_set.plan import PlanShape

ROOT = Path(__file__).resolve().parents[1]
SLOW_PAIR = str(ROOT / "configs/clusters/slow-pair-emulated.toml")
LOCAL = str(ROOT / "configs/clusters/local-emulated.toml")


def _pipeline_key(plan: hetsynth.Plan) -> tuple:
    p = plan.pipeline
    return (plan.shape, len(p.stages), tuple(s.calls for s in p.stages), tuple(tuple(s.ranks) for s in p.stages),
            p.micro_batches, p.schedule, p.predicted.step_time_s)


@pytest.mark.slow
def test_default_returns_the_pipeline_auto_returns_on_a_slow_link() -> None:
    default = hetsynth.plan("gpt:tiny", cluster=SLOW_PAIR)
    auto = hetsynth.plan("gpt:tiny", cluster=SLOW_PAIR, stages="auto")
    spmd = hetsynth.plan("gpt:tiny", cluster=SLOW_PAIR, stages=1)
    assert default.shape is PlanShape.PIPELINE, (default.predicted.step_time_s, default.pipeline)
    assert _pipeline_key(default) == _pipeline_key(auto)
    assert default.pipeline.predicted.step_time_s < 0.98 * spmd.predicted.step_time_s
    assert spmd.shape is PlanShape.SPMD and spmd.pipeline is None
    assert spmd.predicted.step_time_s == pytest.approx(default.predicted.step_time_s, rel=1e-12)  # the same SPMD plan


@pytest.mark.slow
def test_cli_default_writes_the_pipeline_and_stages_1_the_spmd_plan(tmp_path: Path, capsys) -> None:
    from hetsynth.cli import main
    from hetsynth.instruction_set.plan import load_plan

    for flags, shape in (([], PlanShape.PIPELINE), (["--stages", "1"], PlanShape.SPMD)):
        out = tmp_path / f"plan{len(flags)}.json"
        assert main(["plan", "--model", "gpt:tiny", "--cluster", SLOW_PAIR, "--no-cache", "-o", str(out), *flags]) == 0
        printed = capsys.readouterr().out
        assert load_plan(out).shape is shape
        assert (f"chosen: {shape.value}" in printed) == (shape is PlanShape.PIPELINE), printed[-800:]
    out = tmp_path / "zero.json"  # SPMD only, so a forced ZeRO stage is no conflict
    assert main(["plan", "--model", "gpt:tiny", "--cluster", SLOW_PAIR, "--no-cache", "-o", str(out),
                 "--stages", "1", "--zero", "1"]) == 0
    assert load_plan(out).shape is PlanShape.SPMD and load_plan(out).pipeline is None


def test_one_node_fixed_ratios_and_modules_get_no_pipeline_unless_asked() -> None:
    one_node = hetsynth.plan("gpt:tiny", cluster=LOCAL, num_devices=2)  # the fast node of local-emulated
    assert one_node.pipeline is None and one_node.shape is PlanShape.SPMD
    fixed = hetsynth.plan("gpt:tiny", cluster=SLOW_PAIR, ratios=[0.5, 0.5])
    assert fixed.pipeline is None
    module, inputs = _module()
    assert hetsynth.plan(module, inputs, SLOW_PAIR).pipeline is None


def _module() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    class Regression(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(x), y, reduction="sum")

    return Regression(), (torch.randn(8, 8), torch.randn(8, 1))


@pytest.mark.parametrize("kwargs,message", [
    ({"stages": 0}, "stages 0: choose 'auto', 1 (SPMD only) or 2..2"),
    ({"stages": 3}, "stages 3: choose 'auto', 1 (SPMD only) or 2..2"),
    ({"stages": "two"}, "stages 'two': choose 'auto'"),
    ({"stages": True}, "stages True: choose 'auto'"),
    ({"schedule": "zigzag"}, "schedule 'zigzag': use one of gpipe, 1f1b, eager_1f1b"),
    ({"stages": 1, "micro_batches": 2}, "micro-batches (2) and a schedule (None) apply to pipelines, and stages 1"),
    ({"stages": 2, "zero": "2"}, "zero 2 with stages 2: the pipeline runtime keeps every stage's training state"),
    ({"micro_batches": 0}, "micro-batches 0: choose 1..the batch size"),
])
def test_bad_stages_are_errors_before_any_planning(kwargs: dict, message: str, monkeypatch) -> None:
    import hetsynth.api as api

    monkeypatch.setattr(api, "capture_model", lambda *a, **k: pytest.fail("captured before the check"))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hetsynth.plan("gpt:tiny", cluster=SLOW_PAIR, **kwargs)


def test_stages_for_a_module_without_a_reference_is_an_error_before_capture(monkeypatch) -> None:
    import hetsynth.api as api

    monkeypatch.setattr(api, "capture_model", lambda *a, **k: pytest.fail("captured before the check"))
    module, inputs = _module()
    with pytest.raises(ValueError, match="needs a model reference: plan the reference, or the module with model_ref="):
        hetsynth.plan(module, inputs, SLOW_PAIR, stages="auto")


def test_micro_batches_where_no_pipeline_is_considered_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"micro-batches \(2\) and a schedule \(None\) apply to pipelines, and none"):
        hetsynth.plan("gpt:tiny", cluster=LOCAL, num_devices=2, micro_batches=2)  # one node: SPMD only
