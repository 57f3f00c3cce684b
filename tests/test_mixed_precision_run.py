"""A plan's precision policy at run time (runtime.mixed_precision), 4 ranks on gloo, GPT tiny in
float32 on a copy of the local emulated cluster whose kinds have bfloat16 and float16 rates:

- bf16 everywhere: the user's loop trains under autocast (the losses differ from float32's,
  so the compute really is 16-bit) and tracks single-device training under the same autocast
  within 2e-2 relative, for the planner's plan and a tensor-parallel plan (whose collectives
  carry activations between ranks);
- bf16 on the fast kind, fp16 with loss scaling on the slow one (kinds of different 16-bit
  types in one run): trains and tracks the float32 run, also under ZeRO-2 and ZeRO-3; a
  pipeline with a bf16 stage and an fp16 stage likewise;
- fp16 with an overflow injected on one rank: the step is skipped on every rank (no parameter
  moves), the scale halves everywhere, replicated parameters stay equal; the next step trains.
"""

from __future__ import annotations

import tomllib

import pytest
import torch

from hetsynth.instruction_set.cluster import ClusterSpec, cluster_from_dict
from hetsynth.instruction_set.matmul_rates import Dtype
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.planner.baselines import megatron_restrictions
from hetsynth.planner.planner import make_plan
from hetsynth.api import _forced_zero as forced_zero
from test_parity import CLUSTER

# multi-process or seconds long: make test runs them, make test-fast does not
pytestmark = pytest.mark.slow

REF = "gpt:tiny"
STEPS = 3
RATIOS = [0.4, 0.3, 0.2, 0.1]


def cluster(fast: tuple[str, ...] = ("bfloat16", "float16"), slow: tuple[str, ...] = ("bfloat16", "float16")) -> ClusterSpec:
    """The local emulated cluster with the given 16-bit types on each kind (nominal rates)."""
    raw = tomllib.loads(CLUSTER.read_text())
    for kind, dtypes in (("cpu-fast", fast), ("cpu-slow", slow)):
        base = raw["device_kinds"][kind]["throughput_flops"]
        raw["device_kinds"][kind]["matmul_flops"] = {d: 4 * base for d in dtypes}
    return cluster_from_dict(raw, str(CLUSTER))


def batches(count: int) -> list[tuple[torch.Tensor, ...]]:
    spec = parse_model_ref(REF)
    size = spec.batch_size
    return [spec.make_batch(range(i * size, (i + 1) * size), seed=0) for i in range(count)]


def worker(rank: int, world: int, plan, data, overflow_rank: int | None) -> dict:
    import hetsynth
    from hetsynth.runtime.input_rows import input_rows

    torch.manual_seed(0)
    pm = hetsynth.parallelize(parse_model_ref(REF).build("cpu"), plan, check_graph=False)
    rows = input_rows(plan, rank)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    scaler = pm.scaler
    losses, scales, moved = [], [], []
    for step, batch in enumerate(data):
        loss = pm(*[x[r] for x, r in zip(batch, rows)])
        scaler.scale(loss).backward()
        if step == 1 and rank == overflow_rank:  # an overflow on this rank only
            next(p for p in pm.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
        scaler.unscale_(opt)
        pm.clip_grad_norm_(1.0)
        before = [p.detach().clone() for p in pm.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        moved.append(any(not torch.equal(b, p.detach()) for b, p in zip(before, pm.parameters())))
        losses.append(pm.global_loss(loss))
        scales.append(float(scaler.get_scale()))
    return {"losses": losses, "scales": scales, "moved": moved, "state": pm.state_dict()}


def single_device(data, dtype: torch.dtype | None) -> list[float]:
    torch.manual_seed(0)
    model = parse_model_ref(REF).build("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in data:
        with torch.autocast("cpu", dtype=dtype) if dtype is not None else torch.autocast("cpu", enabled=False):
            loss = model(*batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def plan_of(spec: ClusterSpec, precision: str, tp: bool = False):
    from hetsynth import capture_model

    return make_plan(capture_model(REF), spec, ratios=RATIOS, progress=False, with_baselines=False,
                     precision=precision, restrictions=megatron_restrictions(spec) if tp else None)


@pytest.mark.parametrize("tp", [False, True], ids=["planner", "tensor-parallel"])
def test_bf16_tracks_single_device_autocast(pools, tp: bool) -> None:
    spec = cluster()
    plan = plan_of(spec, "bf16", tp)
    assert {k.compute_dtype for k in plan.precision_policy().kinds.values()} == {Dtype.BFLOAT16}
    if tp:
        assert any(i.kind == "param" and i.layout.is_shard for i in plan.instructions), "no sharded parameter"
    data = batches(STEPS)
    got = pools.get(4).run(worker, plan, data, None, timeout_s=600)[0]["losses"]
    want, fp32 = single_device(data, torch.bfloat16), single_device(data, None)
    assert got != fp32, "the run computed in float32"
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 2e-2 * abs(b), f"step {step}: {a} against {b} under autocast on one device"


@pytest.mark.parametrize("zero", [None, 2, 3])
def test_bf16_and_fp16_kinds_in_one_run(pools, zero: int | None) -> None:
    """Also under ZeRO-2 and ZeRO-3 (the optimizer holds rows; the scaler unscales them)."""

    spec = cluster(fast=("bfloat16", "float16"), slow=("float16",))
    plan = plan_of(spec, "auto")
    plan = forced_zero(plan, zero) if zero is not None else plan
    policy = plan.precision_policy()
    assert policy.of("cpu-fast").compute_dtype is Dtype.BFLOAT16
    assert policy.of("cpu-slow").compute_dtype is Dtype.FLOAT16 and policy.loss_scaling
    data = batches(STEPS)
    results = pools.get(4).run(worker, plan, data, None, timeout_s=600)
    fp32 = single_device(data, None)
    for step, (a, b) in enumerate(zip(results[0]["losses"], fp32)):
        assert abs(a - b) <= 2e-2 * abs(b), f"step {step}: {a} against float32's {b}"
    # no step skipped: every rank that updates rows moved them at every step (under ZeRO a rank without state
    # rows, here where the memory-balanced state ratios leave a fast device none, moves by the next gather)
    holders = [rank for rank in range(4) if plan.state_shards is None
               or any(rows[rank] for rows in plan.state_shards.rows.values())]
    assert holders and all(results[rank]["moved"] == [True] * STEPS for rank in holders)


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(pools) -> None:
    plan = plan_of(cluster(), "fp16")
    assert plan.precision_policy().loss_scaling
    results = pools.get(4).run(worker, plan, batches(STEPS), 2, timeout_s=600)
    for rank, r in enumerate(results):
        assert r["moved"] == [True, False, True], (rank, r["moved"])
        assert r["scales"][1] == r["scales"][0] / 2, (rank, r["scales"])
    for r in results[1:]:  # the same parameters on every rank
        assert all(torch.equal(r["state"][k], results[0]["state"][k]) for k in r["state"])


def pipeline_worker(rank: int, world: int, plan, data) -> dict:
    import hetsynth
    from hetsynth.runtime.input_rows import input_rows

    torch.manual_seed(0)
    pm = hetsynth.parallelize(parse_model_ref(REF).build("cpu"), plan, check_graph=False)
    rows = input_rows(plan, rank)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    losses = []
    for batch in data:
        loss = pm.train_step(*[x[r] for x, r in zip(batch, rows)])  # scaled by pm.scaler inside
        pm.scaler.unscale_(opt)
        pm.clip_grad_norm_(1.0)
        pm.scaler.step(opt)
        pm.scaler.update()
        opt.zero_grad()
        losses.append(pm.global_loss(loss))
    return {"losses": losses, "scale": float(pm.scaler.get_scale()), "enabled": pm.scaler.is_enabled()}


def test_pipeline_with_bf16_and_fp16_stages(pools) -> None:
    """Stage 0 on the fast kind in bf16, stage 1 on the slow kind in fp16 with loss scaling:
    the boundary carries the plan's dtype, train_step scales by the scaler."""
    from hetsynth.instruction_set.mixed_precision import KindPrecision, Precision, PrecisionPolicy
    from hetsynth.instruction_set.schedule import Schedule
    from test_pipeline_parity import pipeline_plans

    (plan,) = pipeline_plans(REF, 2, 3, (Schedule.ONE_F_ONE_B,))
    policy = PrecisionPolicy(precision=Precision.AUTO,
                             kinds={"cpu-fast": KindPrecision(compute_dtype=Dtype.BFLOAT16),
                                    "cpu-slow": KindPrecision(compute_dtype=Dtype.FLOAT16, loss_scaling=True)})
    plan = plan.model_copy(update={"precision": policy})
    data = batches(STEPS)
    results = pools.get(4).run(pipeline_worker, plan, data, timeout_s=600)
    fp32 = single_device(data, None)
    assert all(r["enabled"] for r in results) and len({r["scale"] for r in results}) == 1
    assert results[0]["losses"] != fp32, "the run computed in float32"
    for step, (a, b) in enumerate(zip(results[0]["losses"], fp32)):
        assert abs(a - b) <= 2e-2 * abs(b), f"step {step}: {a} against float32's {b}"


def _cli(*args: str, env: dict[str, str] | None = None, cwd=None):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "hetsynth", *args], capture_output=True, text=True, timeout=900,
                          cwd=cwd, env={**os.environ, **(env or {})})


def test_run_check_of_a_bf16_plan_says_what_it_compared(tmp_path) -> None:
    """`hetsynth run --check` of a bf16 plan on the local emulated cluster (its kinds have
    bfloat16): the run against bf16 autocast on one device, then the float64 twin decides."""
    import json

    plan = tmp_path / "bf16.json"
    made = _cli("plan", "--model", REF, "--cluster", str(CLUSTER), "--precision", "bf16", "-o", str(plan))
    assert made.returncode == 0, made.stderr[-2000:]
    assert json.loads(plan.read_text())["precision"]["precision"] == "bf16"
    done = _cli("run", str(plan), "--steps", "3", "--check", cwd=tmp_path)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    assert "float32 with precision bf16" in text and "against bfloat16 autocast on one device" in text, text[-3000:]
    assert "within bfloat16 tolerance" in text and "float64:" in text and ": OK" in text, text[-3000:]


def test_run_check_of_a_plan_reducing_in_bf16_says_so(tmp_path) -> None:
    """`hetsynth run --check` of a float32 plan made with --reduce-dtype bfloat16: the run against
    float32 on one device at bfloat16's tolerances, said in the line; the float64 twin decides."""
    plan = tmp_path / "reduce.json"
    made = _cli("plan", "--model", REF, "--cluster", str(CLUSTER), "--reduce-dtype", "bfloat16", "-o", str(plan))
    assert made.returncode == 0, made.stderr[-2000:]
    done = _cli("run", str(plan), "--steps", "3", "--check", cwd=tmp_path)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    assert "gradients reduced in bfloat16, against float32 on one device, at bfloat16's tolerances" in text, text[-3000:]
    assert "within bfloat16 tolerance" in text and "float64:" in text and ": OK" in text, text[-3000:]


def test_run_with_an_overflow_on_one_rank_skips_that_step(tmp_path) -> None:
    """`hetsynth run` of an fp16 plan, HETSYNTH_FAULT=2:1:overflow: step 2's update is skipped
    on every rank and the scale halves; the run goes on."""
    import json

    plan = tmp_path / "fp16.json"
    assert _cli("plan", "--model", REF, "--cluster", str(CLUSTER), "--precision", "fp16", "-o", str(plan)).returncode == 0
    report = tmp_path / "report.json"
    done = _cli("run", str(plan), "--steps", "3", "--report", str(report), env={"HETSYNTH_FAULT": "2:1:overflow"},
                cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    scales = json.loads(report.read_text())["loss_scales"]
    assert scales[1] == scales[0] / 2 and scales[2] == scales[1], scales


@pytest.mark.parametrize("zero", [None, 2, 3])
def test_gradients_reduced_in_bfloat16(pools, zero: int | None) -> None:
    """A float32 plan whose gradients are reduced in bfloat16 (plain buckets, ZeRO-2's
    reduce-scatter buckets, ZeRO-3's reduce-scatters): it trains, tracks float32 within 2e-2,
    and the rounding is real (the losses after the first update are not float32's)."""
    from hetsynth import capture_model

    plan = make_plan(capture_model(REF), cluster(), ratios=RATIOS, progress=False, with_baselines=False,
                     reduce_dtype="bfloat16")
    plan = forced_zero(plan, zero) if zero is not None else plan
    assert plan.precision_policy().reduce_dtype == "bfloat16" and not plan.precision_policy().is_mixed
    data = batches(STEPS)
    got = pools.get(4).run(worker, plan, data, None, timeout_s=600)[0]["losses"]
    fp32 = single_device(data, None)
    assert got[0] == pytest.approx(fp32[0], rel=1e-6)  # the first forward precedes any reduction
    assert any(abs(a - b) > 1e-6 * abs(b) for a, b in zip(got[1:], fp32[1:])), (got, fp32)
    for step, (a, b) in enumerate(zip(got, fp32)):
        assert abs(a - b) <= 2e-2 * abs(b), f"step {step}: {a} against float32's {b}"


def test_pipeline_gradients_reduced_in_bfloat16(pools) -> None:
    """A float32 pipeline whose stages' gradient syncs carry bfloat16: it trains, tracks
    float32 within 2e-2, and the rounding is real."""
    from hetsynth.instruction_set.mixed_precision import choose_policy
    from hetsynth.instruction_set.schedule import Schedule
    from test_pipeline_parity import pipeline_plans

    (plan,) = pipeline_plans(REF, 2, 3, (Schedule.ONE_F_ONE_B,))
    plan = plan.model_copy(update={"precision": choose_policy(plan.cluster, "fp32", "bfloat16")})
    data = batches(STEPS)
    got = pools.get(4).run(pipeline_worker, plan, data, timeout_s=600)[0]["losses"]
    fp32 = single_device(data, None)
    assert any(abs(a - b) > 1e-6 * abs(b) for a, b in zip(got[1:], fp32[1:])), (got, fp32)
    for step, (a, b) in enumerate(zip(got, fp32)):
        assert abs(a - b) <= 2e-2 * abs(b), f"step {step}: {a} against float32's {b}"


def test_sfb_factors_travel_in_bfloat16(pools) -> None:
    """Weights synchronised by SFB under --reduce-dtype bfloat16: their factors are costed at half
    the bytes (the same program's SFB instructions predicted faster) and the run trains within
    2e-2 of float32."""
    import dataclasses

    from hetsynth import capture_model
    from hetsynth.planner.planner import DP_SEED
    from test_parity import nodes

    graph = capture_model(REF)
    force = {n: "S0" for n in nodes(graph, "aten.linear.default", "blocks")}
    plans = {r: make_plan(graph, cluster(), ratios=RATIOS, progress=False, with_baselines=False, reduce_dtype=r,
                          restrictions=dataclasses.replace(DP_SEED, force_sfb=True, force=force))
             for r in ("float32", "bfloat16")}
    sfb = {r: [i.predicted_s for i in p.instructions if i.kind == "sfb"] for r, p in plans.items()}
    assert sfb["float32"] and len(sfb["bfloat16"]) == len(sfb["float32"])
    assert all(a < b for a, b in zip(sfb["bfloat16"], sfb["float32"])), sfb
    data = batches(STEPS)
    got = pools.get(4).run(worker, plans["bfloat16"], data, None, timeout_s=600)[0]["losses"]
    for step, (a, b) in enumerate(zip(got, single_device(data, None))):
        assert abs(a - b) <= 2e-2 * abs(b), f"step {step}: {a} against float32's {b}"
