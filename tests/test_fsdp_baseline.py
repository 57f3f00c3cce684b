"""The torch FSDP2 baselines (runtime.fsdp) train the global batch: with throughput-proportional
(uneven) rows and loss weights, with and without activation checkpointing, the losses and the
gathered parameters match single-device training in float64; so the baseline's only difference
from hetsynth's plan is how it places the work."""

from __future__ import annotations

import pytest

from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.runtime.config import TrainConfig
from hetsynth.runtime.fsdp import even_rows, proportional_rows
from hetsynth.runtime.train import reference_training

CONFIG = TrainConfig(steps=3, optimizer="adamw", lr=1e-2, max_grad_norm=1.0)
REF = "gpt:tiny,dtype=float64,batch_size=8"


def fsdp_worker(rank: int, world: int, ref: str, rows: tuple[int, ...], checkpoint: bool) -> tuple:
    import torch.distributed as dist

    from hetsynth.runtime.fsdp import fsdp_parameters, fsdp_setup

    trainer = fsdp_setup(parse_model_ref(ref), rows, CONFIG, group=dist.group.WORLD, rank=rank, weighted=True,
                         checkpoint=checkpoint)
    losses = [trainer.step(step).loss for step in range(CONFIG.steps)]
    return losses, fsdp_parameters(trainer)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_proportional_weighted_rows_train_the_global_batch(pools, checkpoint: bool) -> None:
    rows = (3, 5)
    results = pools.get(len(rows)).run(fsdp_worker, REF, rows, checkpoint, timeout_s=300)
    want_losses, want = reference_training(parse_model_ref(REF), sum(rows), CONFIG)
    loss_err = max(abs(g - w) / abs(w) for g, w in zip(results[0][0], want_losses))
    param_err = max(float((results[0][1][k] - v).abs().max()) for k, v in want.items())
    assert loss_err <= 1e-9 and param_err <= 1e-8, (loss_err, param_err)


def test_rows() -> None:
    assert even_rows(10, 4) == [3, 3, 2, 2]
    assert proportional_rows(12, [2, 2, 1, 1]) == [4, 4, 2, 2]
    assert sum(proportional_rows(13, [2, 2, 1, 1])) == 13
