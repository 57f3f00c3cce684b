"""`hetsynth.parallelize` of a pipeline plan trains the user's module in the user's own loop
exactly as one device does (gloo, world size 4, float64): 2 stages {0,1} | {2,3}, ratios
0.7/0.3 in the first, a batch of 8 in micro-batches (3, 3, 2), GPT's embedding tied across the
stages; AdamW with two param groups, LambdaLR, clip_grad_norm_, two accumulation micro-steps
per optimizer step (the first under no_sync). Losses within 1e-9 relative, the state dict within
1e-8; `pm(*inputs)` with gradients is an error naming train_step, under no_grad an evaluation
pass; the local pieces write every element once; state dicts and buffers load back."""

from __future__ import annotations

import pytest
import torch

from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.instruction_set.plan import Plan
from hetsynth.instruction_set.schedule import Schedule
from test_pipeline_parity import pipeline_plans

REF = "gpt:tiny,dtype=float64"
STEPS = 2


def _optimizer(named: list[tuple[str, torch.nn.Parameter]]) -> tuple[torch.optim.Optimizer, object]:
    decay = [p for _, p in named if p.dim() >= 2]
    rest = [p for _, p in named if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _batch(spec, plan: Plan, index: int) -> tuple[torch.Tensor, ...]:
    size = plan.model.batch_size
    return spec.make_batch(range(index * size, (index + 1) * size), seed=0)


def user_worker(rank: int, world: int, plan: Plan) -> dict:
    from hetsynth.parallel import parallelize
    from hetsynth.runtime.input_rows import input_rows

    spec = parse_model_ref(plan.model.ref)
    torch.manual_seed(0)
    pm = parallelize(spec.build("cpu"), plan, check_graph=False)
    opt, sched = _optimizer(list(pm.named_parameters()))
    rows = input_rows(plan, rank)
    mine = lambda index: [x[r] for x, r in zip(_batch(spec, plan, index), rows)]  # noqa: E731
    try:
        pm(*mine(0))
        error = ""
    except RuntimeError as err:
        error = str(err)
    with torch.no_grad():
        evaluated = pm.global_loss(pm(*mine(0)))
    losses = []
    for step in range(STEPS):
        with pm.no_sync():
            first = pm.train_step(*mine(2 * step))
        second = pm.train_step(*mine(2 * step + 1))
        losses.append(pm.global_loss(first) + pm.global_loss(second))
        pm.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    owned = sum(p.tensor.numel() for p in pm.local_pieces().values() if p.owner)
    trained, buffers = pm.state_dict(), pm.whole_buffers()
    pm.load_state_dict({k: torch.zeros_like(v) for k, v in trained.items()})
    zeroed = all(not v.any() for v in pm.state_dict().values())
    pm.load_state_dict(trained)
    pm.load_buffers(buffers)
    return {"error": error, "evaluated": evaluated, "losses": losses, "owned": owned, "buffers": set(buffers),
            "zeroed": zeroed,
            "state": pm.state_dict(rank0_only=True)}


def reference(plan: Plan) -> tuple[float, list[float], torch.nn.Module]:
    spec = parse_model_ref(plan.model.ref)
    torch.manual_seed(0)
    model = spec.build("cpu")
    opt, sched = _optimizer(list(model.named_parameters()))
    with torch.no_grad():
        evaluated = float(model(*_batch(spec, plan, 0)))
    losses = []
    for step in range(STEPS):
        total = 0.0
        for k in range(2):
            loss = model(*_batch(spec, plan, 2 * step + k))
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return evaluated, losses, model


@pytest.mark.parametrize("schedule", [Schedule.ONE_F_ONE_B])
def test_user_loop_matches_one_device(pools, schedule: Schedule) -> None:
    (plan,) = pipeline_plans(REF, 2, 3, (schedule,))
    results = pools.get(4).run(user_worker, plan, timeout_s=300)
    evaluated, losses, model = reference(plan)
    assert all("train_step" in r["error"] for r in results), [r["error"] for r in results]
    assert abs(results[0]["evaluated"] - evaluated) <= 1e-9 * abs(evaluated)
    for step, (got, want) in enumerate(zip(results[0]["losses"], losses)):
        assert abs(got - want) <= 1e-9 * abs(want), f"step {step}: loss {got} != {want}"
    state, want = results[0]["state"], model.state_dict()
    assert set(state) == set(want) and all(r["state"] == {} for r in results[1:])
    for key, value in state.items():
        err = float((value - want[key]).abs().max()) if value.numel() else 0.0
        assert err <= 1e-8, f"{key}: max difference {err}"
    torch.nn.Module.load_state_dict(parse_model_ref(REF).build("cpu"), state, strict=True)
    assert all(r["zeroed"] for r in results)
    assert results[0]["buffers"] == set(want) - {k for k, _ in model.named_parameters(remove_duplicate=False)}
    numel = sum(p.numel() for p in model.parameters())  # tied parameters once
    assert sum(r["owned"] for r in results) == numel


def scale_worker(rank: int, world: int, plan: Plan) -> list[float]:
    """The global gradient norm after train_step with loss_scale 1, 0.5 and 3 on one batch."""
    from hetsynth.parallel import parallelize
    from hetsynth.runtime.input_rows import input_rows

    spec = parse_model_ref(plan.model.ref)
    torch.manual_seed(0)
    pm = parallelize(spec.build("cpu"), plan, check_graph=False)
    mine = [x[r] for x, r in zip(_batch(spec, plan, 0), input_rows(plan, rank))]
    norms = []
    for scale in (1.0, 0.5, 3.0):
        pm.train_step(*mine, loss_scale=scale)
        norms.append(float(pm.clip_grad_norm_(1e9)))
        for p in pm.parameters():
            p.grad = None
    return norms


@pytest.mark.parametrize("shape", ["pipeline", "spmd"])
def test_train_step_scales_the_backward(pools, shape: str) -> None:
    """train_step(..., loss_scale=c) gives c times the gradients, for both plan shapes."""
    from test_parallelize import RATIOS
    from hetsynth.instruction_set.cluster import load_cluster
    from hetsynth.planner.planner import make_plan
    from test_parity import CLUSTER
    import hetsynth

    if shape == "pipeline":
        (plan,) = pipeline_plans(REF, 2, 3, (Schedule.ONE_F_ONE_B,))
    else:
        plan = make_plan(hetsynth.capture_model(REF), load_cluster(CLUSTER), ratios=RATIOS, progress=False,
                         with_baselines=False)
    for norms in pools.get(4).run(scale_worker, plan, timeout_s=300):
        assert norms[0] > 0
        assert abs(norms[1] - 0.5 * norms[0]) <= 1e-12 * norms[0], norms
        assert abs(norms[2] - 3.0 * norms[0]) <= 1e-12 * norms[0], norms
