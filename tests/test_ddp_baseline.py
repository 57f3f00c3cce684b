"""The torch DDP baselines (runtime.ddp) train the global batch: with uneven rows and loss
weights (DDP-CP) the losses and parameters match single-device training in float64, also for
BERT, whose ranks hold different numbers of masked labels; without the weights they do not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.runtime.config import TrainConfig
from hetsynth.runtime.train import reference_training

CONFIG = TrainConfig(steps=4, optimizer="adamw", lr=1e-2, max_grad_norm=1.0)


def ddp_worker(rank: int, world: int, ref: str, rows: tuple[int, ...], weighted: bool) -> tuple:
    import torch.distributed as dist

    from hetsynth.runtime.ddp import ddp_parameters, ddp_setup

    trainer = ddp_setup(parse_model_ref(ref), rows, CONFIG, group=dist.group.WORLD, rank=rank, weighted=weighted)
    losses = [trainer.step(step).loss for step in range(CONFIG.steps)]
    return losses, ddp_parameters(trainer)


def max_errors(pools, ref: str, rows: tuple[int, ...], weighted: bool) -> tuple[float, float]:
    """(largest relative loss error, largest parameter error) against one device."""
    results = pools.get(len(rows)).run(ddp_worker, ref, rows, weighted, timeout_s=300)
    want_losses, want = reference_training(parse_model_ref(ref), sum(rows), CONFIG)
    loss_err = max(abs(g - w) / abs(w) for g, w in zip(results[0][0], want_losses))
    param_err = max(float((results[0][1][k] - v).abs().max()) for k, v in want.items())
    for other in results[1:]:  # every rank holds the same parameters
        assert all(torch.equal(other[1][k], results[0][1][k]) for k in want)
    return loss_err, param_err


@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_weighted_uneven_rows_train_the_global_batch(pools, model: str) -> None:
    loss_err, param_err = max_errors(pools, f"{model}:tiny,dtype=float64,batch_size=8", (3, 5), True)
    assert loss_err <= 1e-9 and param_err <= 1e-8, (loss_err, param_err)


def test_unweighted_uneven_rows_do_not(pools) -> None:
    """DDP as users run it averages the ranks' means: with 3 and 5 rows that is not the
    global batch's gradient (what the weights are for)."""
    _, param_err = max_errors(pools, "gpt:tiny,dtype=float64,batch_size=8", (3, 5), False)
    assert param_err > 1e-6


def test_a_rank_without_rows_is_refused() -> None:
    from hetsynth.runtime.ddp import DDPSetupError, ddp_setup

    with pytest.raises(DDPSetupError, match=r"at least one row per rank; rows \[8, 0\]"):
        ddp_setup(parse_model_ref("gpt:tiny"), (8, 0), CONFIG, group=None, rank=0, weighted=True)


def test_compare_ddp_entries_parse_and_take_a_plans_rows() -> None:
    from hetsynth.instruction_set.cluster import load_cluster
    from hetsynth import capture_model
    from hetsynth.planner import baselines
    from hetsynth.planner.planner import make_plan
    from hetsynth.runtime.compare import parse_ddp, parse_user, plan_rows

    assert parse_ddp("ddp_cp=weighted:/tmp/p.json") == ("ddp_cp", "weighted", "/tmp/p.json")
    with pytest.raises(ValueError, match="MODE one of mean, weighted"):
        parse_ddp("ddp=sum:/tmp/p.json")
    assert parse_user("loop=/tmp/p.json") == ("loop", "/tmp/p.json")
    with pytest.raises(ValueError, match="expected NAME=PLAN"):
        parse_user("/tmp/p.json")
    cluster = load_cluster(Path(__file__).resolve().parents[1] / "configs" / "clusters" / "local-emulated.toml")
    plan = make_plan(capture_model("gpt:tiny,batch_size=10"), cluster, ratios=[0.4, 0.3, 0.2, 0.1],
                     restrictions=baselines.DP, progress=False, with_baselines=False)
    assert plan_rows(plan) == [4, 3, 2, 1]
