"""Checkpoints: a distributed checkpoint loads into the plain model, and resumes under a
different plan (other ratios, other world size) with the continued losses of single-device
training."""

from __future__ import annotations

from pathlib import Path

import torch

from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.runtime.config import TrainConfig
from hetsynth.runtime.train import reference_training
from test_parity import make

REF = "gpt:tiny,dtype=float64"
FIRST, LATER = TrainConfig(steps=3, lr=1e-2), TrainConfig(steps=5, lr=1e-2)


def save_worker(rank: int, world: int, plan, config: TrainConfig, path: str) -> list[float]:
    import torch.distributed as dist

    from hetsynth.runtime.checkpoint import save_checkpoint
    from hetsynth.runtime.groups import Groups
    from hetsynth.runtime.train import setup, train_step

    trainer = setup(plan, Groups.create(plan.mesh, rank, world=dist.group.WORLD), config)
    losses = [train_step(trainer, s).loss for s in range(config.steps)]
    save_checkpoint(trainer, path, config.steps)
    return losses


def resume_worker(rank: int, world: int, plan, config: TrainConfig, path: str) -> list[float]:
    import torch.distributed as dist

    from hetsynth.runtime.checkpoint import load_checkpoint
    from hetsynth.runtime.groups import Groups
    from hetsynth.runtime.train import setup, train_step

    trainer = setup(plan, Groups.create(plan.mesh, rank, world=dist.group.WORLD), config)
    start = load_checkpoint(trainer, path)
    return [train_step(trainer, s).loss for s in range(start, config.steps)]


def test_checkpoint_loads_into_plain_model_and_resumes_elsewhere(pools, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt.pt")
    first = pools.get(2).run(save_worker, make(REF, [0.7, 0.3]), FIRST, path)[0]

    spec = parse_model_ref(REF)
    expected_losses, expected_params = reference_training(spec, spec.batch_size, FIRST)
    assert all(abs(a - b) <= 1e-9 * abs(b) for a, b in zip(first, expected_losses))

    model = spec.build("cpu")
    model.load_state_dict(torch.load(path, weights_only=False)["model"])
    batch = spec.make_batch(range(8), seed=9)
    single = spec.build("cpu")
    single.load_state_dict({k: expected_params.get(k, v) for k, v in single.state_dict().items()}, strict=False)
    torch.testing.assert_close(model(*batch), single(*batch), rtol=1e-10, atol=1e-10)

    later = pools.get(4).run(resume_worker, make(REF, [0.1, 0.2, 0.3, 0.4]), LATER, path)[0]
    continued, _ = reference_training(spec, spec.batch_size, LATER)
    assert len(later) == 2
    for got, want in zip(later, continued[3:]):
        assert abs(got - want) <= 1e-9 * abs(want), (later, continued[3:])
