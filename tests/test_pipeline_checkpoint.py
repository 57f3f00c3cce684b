"""Checkpoints across plan shapes: a run saved under a pipeline plan resumes under an SPMD plan,
which saves again, and a pipeline plan resumes that; every step's loss is single-device
training's (float64, 1e-9 relative), the final parameters too (1e-8), and the pipeline's
checkpoint loads into the plain model."""

from __future__ import annotations

from pathlib import Path

import torch

from hetsynth import capture_model
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.instruction_set.plan import Plan
from hetsynth.planner.pipeline import block_starts, make_pipeline_plan
from hetsynth.planner.planner import make_plan
from hetsynth.runtime.config import TrainConfig
from hetsynth.runtime.train import reference_training

REF = "gpt:tiny,dtype=float64"
CLUSTER = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "local-emulated.toml"
CONFIG = TrainConfig(steps=5, optimizer="adamw", lr=1e-2, max_grad_norm=1.0)


def pipe_worker(rank: int, world: int, plan: Plan, config: TrainConfig, steps: tuple[int, int],
                resume: str | None, save: str) -> tuple[list[float], dict]:
    import torch.distributed as dist

    from hetsynth.runtime.pipeline.checkpoint import load_pipeline_checkpoint, save_pipeline_checkpoint
    from hetsynth.runtime.pipeline.trainer import local_parameters, setup, train_step

    trainer = setup(plan, rank, config, world=dist.group.WORLD)
    start = load_pipeline_checkpoint(trainer, resume, steps[1]) if resume else 0
    assert start == steps[0], (start, steps)
    losses = [train_step(trainer, s) for s in range(start, steps[1])]
    save_pipeline_checkpoint(trainer, save, steps[1])
    return losses, local_parameters(trainer)


def spmd_worker(rank: int, world: int, plan: Plan, config: TrainConfig, steps: tuple[int, int],
                resume: str, save: str) -> list[float]:
    import torch.distributed as dist

    from hetsynth.runtime.checkpoint import load_checkpoint, save_checkpoint
    from hetsynth.runtime.groups import Groups
    from hetsynth.runtime.train import setup, train_step

    trainer = setup(plan, Groups.create(plan.mesh, rank, world=dist.group.WORLD), config)
    start = load_checkpoint(trainer, resume, steps[1])
    assert start == steps[0], (start, steps)
    losses = [train_step(trainer, s).loss for s in range(start, steps[1])]
    save_checkpoint(trainer, save, steps[1])
    return losses


def plans() -> tuple[Plan, Plan]:
    """A 2-stage pipeline (3 micro-batches of a batch of 8: 3, 3, 2) and an SPMD plan at
    ratios 0.7 / 0.3, both on two devices."""
    graph, cluster = capture_model(REF), load_cluster(CLUSTER).first(2)
    spmd = make_plan(graph, cluster, ratios=[0.7, 0.3], width=8, progress=False, with_baselines=False)
    cut, n = block_starts(graph)[1], len(graph.calls)
    pipeline = make_pipeline_plan(spmd, parse_model_ref(REF), [(range(0, 1), (0, cut)), (range(1, 2), (cut, n))],
                                  num_micro=3, width=8)
    return pipeline, spmd


def test_pipeline_and_spmd_checkpoints_resume_each_other(pools, tmp_path: Path) -> None:
    from hetsynth.runtime.pipeline.trainer import assemble

    pipeline, spmd = plans()
    a, b, c = (str(tmp_path / f"{x}.pt") for x in "abc")
    first = pools.get(2).run(pipe_worker, pipeline, CONFIG, (0, 2), None, a)[0][0]
    middle = pools.get(2).run(spmd_worker, spmd, CONFIG, (2, 4), a, b)[0]
    results = pools.get(2).run(pipe_worker, pipeline, CONFIG, (4, 5), b, c)
    spec = parse_model_ref(REF)
    want_losses, want = reference_training(spec, spec.batch_size, CONFIG)
    got = first + middle + results[0][0]
    assert len(got) == 5
    assert all(abs(g - w) <= 1e-9 * abs(w) for g, w in zip(got, want_losses)), (got, want_losses)
    params = assemble(pipeline, [r[1] for r in results])
    assert params and max(float((v - want[k]).abs().max()) for k, v in params.items()) <= 1e-8

    model = spec.build("cpu")
    model.load_state_dict(torch.load(c, weights_only=True)["model"])  # strict: every key, tied ones too
    for name, value in model.named_parameters():
        torch.testing.assert_close(value.detach(), want[name], rtol=0, atol=1e-8)
