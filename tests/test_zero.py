"""ZeRO-1 (instruction_set.training_state, planner.zero, runtime.zero): the optimizer state of
replicated parameters sharded in rows of uneven lengths sized by the state LP from each
device's memory and speed; plans train exactly as single-device training (float64, 5 AdamW
steps, uneven rows, a zero-length shard), and checkpoints hold whole optimizer state.

The default suite runs ZeRO-1 at every case, ZeRO-2 and ZeRO-3 each at one uneven world with
a zero-length shard (`SUBSET`), and ZeRO-3's measured memory; `HETSYNTH_ZERO_MATRIX=1` runs
every case at every stage and variant, ViT, VGG, ResNet (BatchNorm buffers) and MoE at ZeRO-2
and ZeRO-3 too (`ZOO_CASES`), and ZeRO-2's measured memory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hetsynth import capture_model
from hetsynth.trace import predicted_step
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.instruction_set.plan import Plan, load_plan, save_plan
from hetsynth.instruction_set.training_state import TrainingState
from hetsynth.planner.planner import DP_SEED, make_plan, with_zero, with_zero1
from hetsynth.planner.problem import Problem
from hetsynth.planner.zero import solve_state_ratios, with_states, zero_candidates
from test_parity import check, make


# (model, compute ratios, state ratios q): worlds 2 and 4, uneven rows, a rank without rows
CASES = [("gpt:tiny,dtype=float64", [0.6, 0.4], [0.3, 0.7]),
         ("gpt:tiny,dtype=float64", [0.4, 0.3, 0.2, 0.1], [0.1, 0.0, 0.5, 0.4]),
         ("bert:tiny,dtype=float64", [0.5, 0.5], [0.0, 1.0]),
         ("bert:tiny,dtype=float64", [0.5, 0.3, 0.2, 0.0], [0.4, 0.3, 0.2, 0.1])]


MATRIX = bool(os.environ.get("HETSYNTH_ZERO_MATRIX"))
# the other zoo families in the matrix: a ViT, convolutions (VGG; ResNet with BatchNorm
# buffers), experts (MoE), uneven rows with a rank without rows
ZOO_CASES = [(f"{m}:tiny,dtype=float64", [0.4, 0.3, 0.2, 0.1], [0.5, 0.0, 0.3, 0.2])
             for m in ("vit", "vgg", "resnet", "moe")]
ZERO2_CASES = [(*c, v) for c, v in zip(CASES + ZOO_CASES, ["padded", "grouped"] * 4)]
SUBSET = {"zero2": [(*CASES[1], "padded")], "zero3": [CASES[2]]}  # gpt world 4 (a rank without rows); bert q 0/1


def stage_cases(stage: str, cases: list) -> list:
    """`cases` under HETSYNTH_ZERO_MATRIX=1, else the stage's SUBSET."""
    return cases if MATRIX else SUBSET[stage]


def zero_params(plan: Plan, state: TrainingState = TrainingState.ZERO1) -> list[str]:
    return [i.tensor for i in plan.instructions if i.kind == "param" and i.state == state]


@pytest.mark.parametrize("ref, ratios, q", CASES)
def test_zero1_matches_single_device(pools, ref: str, ratios: list[float], q: list[float]) -> None:
    plan = with_zero1(make(ref, ratios, DP_SEED), q)
    rows = plan.state_shards.rows
    assert zero_params(plan) and set(rows) == set(zero_params(plan))
    assert any(len(set(r)) > 1 for r in rows.values())           # uneven rows
    if 0.0 in q:
        assert all(r[q.index(0.0)] == 0 for r in rows.values())   # a rank with no optimizer state
    predicted_step(plan)  # the trace lays out the post-step gather as the prediction does
    check(pools, plan)


@pytest.mark.parametrize("ref, ratios, q, scatter", stage_cases("zero2", ZERO2_CASES))
def test_zero2_matches_single_device(pools, ref: str, ratios: list[float], q: list[float], scatter: str) -> None:
    """ZeRO-2: gradients reduce-scattered onto uneven rows (a rank with none) in buckets of
    kind reduce_scatter, at either variant; 5 AdamW steps with clipping as on one device."""
    plan = with_zero(make(ref, ratios, DP_SEED), q, TrainingState.ZERO2, scatter)
    assert plan.state_shards.scatter_variant == scatter
    zero2 = zero_params(plan, TrainingState.ZERO2)
    assert zero2 and set(plan.state_shards.rows) == set(zero2)
    scattered = [p for b in plan.buckets() if b.kind == "reduce_scatter" for p in b.params]
    assert sorted(scattered) == sorted(zero2)
    predicted_step(plan)
    check(pools, plan)


@pytest.mark.parametrize("ref, ratios, q", stage_cases("zero3", CASES + ZOO_CASES))
def test_zero3_matches_single_device(pools, ref: str, ratios: list[float], q: list[float]) -> None:
    """ZeRO-3: parameters stored as uneven rows (a rank with none), gathered at each use
    (gpt's tied embedding twice), regathered in the backward; 5 AdamW steps with clipping as
    on one device."""
    plan = with_zero(make(ref, ratios, DP_SEED), q, TrainingState.ZERO3)
    zero3 = zero_params(plan, TrainingState.ZERO3)
    assert zero3 and set(plan.state_shards.rows) == set(zero3)
    assert not any(p in zero3 for b in plan.buckets() for p in b.params)
    predicted_step(plan)
    check(pools, plan)


def zero3_memory_worker(rank: int, world: int, plan: Plan, config):
    import torch.distributed as dist

    from hetsynth.runtime.groups import Groups
    from hetsynth.runtime.memory_report import measure_step
    from hetsynth.runtime.train import setup, train_step

    trainer = setup(plan, Groups.create(plan.mesh, rank, world=dist.group.WORLD), config)
    train_step(trainer, 0)
    gathers = trainer.program.gathers
    before = gathers.regathers if gathers is not None else 0
    memory = measure_step(trainer, lambda: train_step(trainer, 1))
    shapes = {n: tuple(p.shape) for n, p in trainer.program.module.named_parameters()}
    return memory, (gathers.regathers if gathers is not None else 0) - before, shapes


@pytest.mark.parametrize("state", [TrainingState.ZERO2, TrainingState.ZERO3] if MATRIX else [TrainingState.ZERO3])
def test_sharded_state_memory_is_measured_as_predicted(pools, state: TrainingState) -> None:
    """ZeRO-2/3 at uneven rows: every rank holds the parameters, gradients and optimizer state
    the plan predicts (within 15%; ZeRO-3: the module holds its rows only) and saves what it
    predicts for backward (within 25%): ZeRO-3's gathered parameters are released after their
    forward use (not saved) and gathered again in the backward."""
    from hetsynth.runtime.config import TrainConfig
    from hetsynth.runtime.memory_report import format_report, relative_error

    plan = with_zero(make("gpt:tiny", [0.7, 0.3], DP_SEED), [0.65, 0.35], state)
    rows = pools.get(2).run(zero3_memory_worker, plan, TrainConfig(steps=2), timeout_s=300)
    print(format_report(plan, [r[0] for r in rows], "adamw"))
    for rank, (memory, regathers, shapes) in enumerate(rows):
        assert abs(relative_error(memory.predicted_state, memory.state)) <= 0.15, (rank, memory)
        assert abs(relative_error(memory.predicted_saved, memory.saved_peak)) <= 0.25, (rank, memory)
        if state == TrainingState.ZERO3:
            assert regathers > 0
            for name, r in plan.state_shards.rows.items():
                assert shapes[name][0] == r[rank], (name, shapes[name], r)


def _two_devices(tmp_path: Path, memories_gib: tuple[float, float]) -> Path:
    """Two devices of equal speed on one node, with these memories."""
    kinds = "".join(f"[device_kinds.k{i}]\nthroughput_flops = 20e9\nmemory_gib = {m}\n"
                    f"memory_bandwidth_gbyte_s = 5\n\n" for i, m in enumerate(memories_gib))
    nodes = "".join(f'[[nodes]]\nname = "n{i}"\nkind = "k{i}"\nnum_devices = 1\n\n' for i in range(2))
    path = tmp_path / f"two-{memories_gib[0]}-{memories_gib[1]}.toml"
    path.write_text(f'name = "two"\n{kinds}{nodes}[links]\nintra_node_bandwidth_gbps = 8\n'
                    f'inter_node_bandwidth_gbps = 8\n')
    return path


def _rows_at(graph, path: Path) -> tuple[float, ...]:
    cluster = load_cluster(path)
    plan = make_plan(graph, cluster, ratios=[0.5, 0.5], progress=False, with_baselines=False, restrictions=DP_SEED)
    pb = Problem(graph, cluster, plan.sharding_ratios, DP_SEED)
    q, fits = solve_state_ratios(pb, with_states(plan.instructions, zero_candidates(pb, plan.instructions)))
    assert fits
    return q


def test_state_follows_memory_when_speeds_are_equal(tmp_path: Path) -> None:
    """Equal speeds, unequal memories: where the state fits only skewed, the larger memory
    holds more of it, and swapping the memories swaps the shares; ample memory shares evenly."""
    graph = capture_model("gpt:tiny")
    plan = make_plan(graph, load_cluster(_two_devices(tmp_path, (1.0, 1.0))), ratios=[0.5, 0.5], progress=False,
                     with_baselines=False, restrictions=DP_SEED)
    state_gib = plan.predicted.devices[0].state_gib
    other_gib = plan.predicted.devices[0].memory_gib - state_gib
    adam_gib = state_gib / 2                      # of 4 copies, the 2 Adam moments are sharded
    small, big = other_gib + state_gib / 2 + 0.3 * adam_gib, other_gib + state_gib / 2 + 0.9 * adam_gib
    q = _rows_at(graph, _two_devices(tmp_path, (small, big)))
    assert q[0] <= 0.3 + 1e-6 and q[1] > q[0]
    swapped = _rows_at(graph, _two_devices(tmp_path, (big, small)))
    assert swapped == pytest.approx(q[::-1])
    assert _rows_at(graph, _two_devices(tmp_path, (64.0, 64.0))) == pytest.approx((0.5, 0.5))


def test_memory_first_rows_follow_free_memory(tmp_path: Path) -> None:
    """The state LP's memory-first order (the one the planner tries first where memory binds):
    equal speeds, ample but unequal memories (caps 1 : 1.5): the larger memory holds
    more rows, every device is left the same fraction of its memory, and swapping the memories
    swaps the rows. The time-first order shares evenly there (the padded gather's best)."""
    graph = capture_model("gpt:tiny")
    path = _two_devices(tmp_path, (0.001, 0.0015))
    cluster = load_cluster(path)
    plan = make_plan(graph, cluster, ratios=[0.5, 0.5], progress=False, with_baselines=False, restrictions=DP_SEED)
    pb = Problem(graph, cluster, plan.sharding_ratios, DP_SEED)
    program = with_states(plan.instructions, zero_candidates(pb, plan.instructions), TrainingState.ZERO2)
    q, fits = solve_state_ratios(pb, program, "memory")
    assert fits and q[1] > q[0] > 0.0
    used = [d.memory_gib / d.memory_capacity_gib for d in with_zero(plan, q, TrainingState.ZERO2).predicted.devices]
    assert used[0] == pytest.approx(used[1], rel=2e-3)
    swapped = Problem(graph, load_cluster(_two_devices(tmp_path, (0.0015, 0.001))), plan.sharding_ratios, DP_SEED)
    assert solve_state_ratios(swapped, program, "memory")[0] == pytest.approx(q[::-1], abs=1e-6)
    assert solve_state_ratios(pb, program, "time")[0] == pytest.approx((0.5, 0.5), abs=1e-3)
    forced = with_zero(plan, None, TrainingState.ZERO2)  # as `hetsynth plan --zero 2`: the memory-first rows
    assert forced.state_shards.ratios == pytest.approx(q, abs=1e-6)


def test_planner_shards_state_when_memory_binds(pools, tmp_path: Path) -> None:
    """Memory that holds the data-parallel plan only with its optimizer state sharded: the
    planner shards it (ZeRO-1), the plan fits, round-trips as JSON and trains exactly."""
    plain = make("gpt:tiny,dtype=float64", [0.7, 0.3], DP_SEED)
    dev = plain.predicted.devices[0]
    cap = dev.memory_gib - 0.3 * dev.state_gib  # Adam's moments are half the state: sharding them frees < half
    kinds = {k: v.model_copy(update={"memory_gib": cap}) for k, v in plain.cluster.device_kinds.items()}
    cluster = plain.cluster.model_copy(update={"device_kinds": kinds})
    plan = make_plan(plain.graph, cluster, ratios=[0.7, 0.3], progress=False, with_baselines=False,
                     restrictions=DP_SEED)
    assert plan.predicted.fits and plan.state_shards is not None  # ZeRO-1, or ZeRO-2 if faster
    assert max(d.state_gib for d in plan.predicted.devices) < dev.state_gib
    save_plan(plan, tmp_path / "zero.json")
    assert load_plan(tmp_path / "zero.json") == plan
    check(pools, plan)


def test_planner_shards_gradients_where_optimizer_state_is_not_enough() -> None:
    """Memory that ZeRO-1 cannot meet without recomputation (it frees at most the Adam
    moments' share, a quarter of the state at even rows) but ZeRO-2 can (three quarters of it
    at even rows): the planner takes ZeRO-2, and `hetsynth plan` says so."""
    from hetsynth.report import plan_summary_text

    plain = make("gpt:tiny,dtype=float64", [0.5, 0.5], DP_SEED)
    dev = plain.predicted.devices[0]
    cap = dev.memory_gib - 0.33 * dev.state_gib
    kinds = {k: v.model_copy(update={"memory_gib": cap}) for k, v in plain.cluster.device_kinds.items()}
    cluster = plain.cluster.model_copy(update={"device_kinds": kinds})
    plan = make_plan(plain.graph, cluster, ratios=[0.5, 0.5], progress=False, with_baselines=False,
                     restrictions=DP_SEED)
    assert plan.predicted.fits and zero_params(plan, TrainingState.ZERO2) and not zero_params(plan)
    assert {b.kind for b in plan.buckets()} == {"reduce_scatter"}
    assert "ZeRO-2 for" in plan_summary_text(plan)


def test_planner_shards_parameters_where_nothing_else_fits(pools) -> None:
    """Memory that neither ZeRO-2 nor recomputation meets, even together (gpt:tiny at even
    ratios: 0.497 MB per device with every block recomputed), but ZeRO-3 with recomputation
    does (0.474 MB): the planner takes ZeRO-3, gathering parameters inside recomputed blocks,
    and the plan trains exactly."""
    from hetsynth.report import plan_summary_text

    plain = make("gpt:tiny,dtype=float64", [0.5, 0.5], DP_SEED)
    scale = plain.predicted.devices[0].memory_gib / make("gpt:tiny", [0.5, 0.5], DP_SEED).predicted.devices[0].memory_gib
    cap = 0.485e6 / 2**30 * scale  # float64 doubles every byte of the float32 figures above
    kinds = {k: v.model_copy(update={"memory_gib": cap}) for k, v in plain.cluster.device_kinds.items()}
    cluster = plain.cluster.model_copy(update={"device_kinds": kinds})
    plan = make_plan(plain.graph, cluster, ratios=[0.5, 0.5], progress=False, with_baselines=False,
                     restrictions=DP_SEED)
    assert plan.predicted.fits and zero_params(plan, TrainingState.ZERO3)
    assert any(i.recompute for i in plan.instructions)
    assert "ZeRO-3 for" in plan_summary_text(plan)
    check(pools, plan)


def test_checkpoint_under_zero1_holds_whole_state_and_resumes(pools, tmp_path: Path) -> None:
    """Saved under a ZeRO-1 plan, the checkpoint loads into the plain model (whole parameters
    and whole Adam moments) and resumes under another ZeRO-1 plan (4 ranks, one without rows)
    with single-device training's losses."""
    import torch

    from hetsynth.instruction_set.models import parse_model_ref
    from hetsynth.runtime.train import reference_training
    from test_checkpoint import FIRST, LATER, REF, resume_worker, save_worker

    path = str(tmp_path / "zero.pt")
    pools.get(2).run(save_worker, with_zero1(make(REF, [0.7, 0.3], DP_SEED), [0.2, 0.8]), FIRST, path)
    ckpt = torch.load(path, weights_only=False)
    spec = parse_model_ref(REF)
    model = spec.build("cpu")
    model.load_state_dict(ckpt["model"], strict=True)
    shapes = dict(model.named_parameters())
    for fqn, state in ckpt["optimizer"]["state"].items():
        assert state["exp_avg"].shape == shapes[fqn].shape, fqn
    later = pools.get(4).run(resume_worker, with_zero1(make(REF, [0.4, 0.3, 0.2, 0.1], DP_SEED), [0.5, 0.0, 0.25, 0.25]),
                             LATER, path)[0]
    continued, _ = reference_training(spec, spec.batch_size, LATER)
    for got, want in zip(later, continued[3:]):
        assert abs(got - want) <= 1e-9 * abs(want), (later, continued[3:])


def test_checkpoint_under_zero3_loads_into_the_plain_model_and_resumes(pools, tmp_path: Path) -> None:
    """Saved under a ZeRO-3 plan (each rank holding only its rows of the parameters), the
    checkpoint holds whole parameters equal to single-device training's, loads into the plain
    model with strict=True, and resumes under another ZeRO-3 plan (4 ranks, one without rows)
    with single-device training's losses."""
    import torch

    from hetsynth.instruction_set.models import parse_model_ref
    from hetsynth.runtime.train import reference_training
    from test_checkpoint import FIRST, LATER, REF, resume_worker, save_worker

    path = str(tmp_path / "zero3.pt")
    pools.get(2).run(save_worker, with_zero(make(REF, [0.7, 0.3], DP_SEED), [0.3, 0.7], TrainingState.ZERO3),
                     FIRST, path)
    ckpt = torch.load(path, weights_only=False)
    spec = parse_model_ref(REF)
    model = spec.build("cpu")
    model.load_state_dict(ckpt["model"], strict=True)
    _, first = reference_training(spec, spec.batch_size, FIRST)
    for fqn, value in model.named_parameters():
        assert float((value.detach() - first[fqn]).abs().max()) <= 1e-8, fqn
        assert ckpt["optimizer"]["state"][fqn]["exp_avg"].shape == value.shape, fqn
    plan = with_zero(make(REF, [0.4, 0.3, 0.2, 0.1], DP_SEED), [0.5, 0.0, 0.25, 0.25], TrainingState.ZERO3)
    later = pools.get(4).run(resume_worker, plan, LATER, path)[0]
    continued, _ = reference_training(spec, spec.batch_size, LATER)
    for got, want in zip(later, continued[3:]):
        assert abs(got - want) <= 1e-9 * abs(want), (later, continued[3:])


def _with_state_on(plan: Plan, tensor: str, state: str) -> dict:
    """The plan's JSON with one parameter's training state set, at even rows."""
    import json

    raw = json.loads(plan.model_dump_json())
    for i in raw["instructions"]:
        if i["kind"] == "param" and i["tensor"] == tensor:
            i["state"] = state
    rows = plan.graph.node(tensor).out.shape[0]
    raw["state_shards"] = {"ratios": [0.5, 0.5], "rows": {tensor: [rows // 2, rows - rows // 2]}}
    return raw


@pytest.mark.slow
def test_plans_that_shard_state_where_the_runtime_cannot_are_refused(tmp_path: Path) -> None:
    """A plan file whose ZeRO state the runtime cannot hold is an error when it is read, and
    `hetsynth run` says so (exit 2, no traceback): ZeRO on a split parameter; ZeRO-3 on a
    weight whose gradient SFB rebuilds."""
    import dataclasses
    import json
    import subprocess
    import sys

    from hetsynth.instruction_set.plan import PlanError, plan_from_json
    from hetsynth.planner.problem import Restrictions

    force = {n.name: "S0" for n in capture_model("gpt:tiny").calls
             if n.target == "aten.linear.default" and "blocks" in n.module_path}
    sfb = make("gpt:tiny", [0.5, 0.5], dataclasses.replace(DP_SEED, force_sfb=True, force=force))
    weight = next(i.tensor for i in sfb.instructions if i.kind == "sfb")
    raw = _with_state_on(sfb, weight, "zero3")
    with pytest.raises(PlanError, match=f"zero3 parameter.*{weight}.*sfb"):
        plan_from_json(raw, "sfb.json")
    path = tmp_path / "sfb.json"
    path.write_text(json.dumps(raw))
    done = subprocess.run([sys.executable, "-m", "hetsynth", "run", str(path), "--steps", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "error:" in done.stderr and "Traceback" not in done.stderr, done.stderr
    split = make("gpt:tiny", [0.5, 0.5], Restrictions(shard_params_with_dims=2))
    name, layout = next((i.tensor, i.layout) for i in split.instructions if i.kind == "param" and i.layout.is_shard)
    with pytest.raises(PlanError, match=f"parameter {name} is stored {layout} with training state zero2"):
        plan_from_json(_with_state_on(split, name, "zero2"), "split.json")


@pytest.mark.slow
def test_zero2_leaves_sufficient_factor_gradients_whole() -> None:
    """VGG's fc1 gradient is synced by broadcasting its sufficient factors (SFB), whole on every
    rank, not by the all-reduce a ZeRO-2 bucket turns into a reduce-scatter: ZeRO-2 keeps its
    state whole and shards the rest (before, fc1 was marked ZeRO-2 with no bucket, and the
    run drifted from one device by 1e-2 in the loss at step 2; the parity case is in the
    HETSYNTH_ZERO_MATRIX run)."""
    plan = with_zero(make("vgg:tiny,dtype=float64", [0.4, 0.3, 0.2, 0.1], DP_SEED), [0.5, 0.0, 0.3, 0.2],
                     TrainingState.ZERO2, "grouped")
    sfb = {i.tensor for i in plan.instructions if i.kind == "sfb"}
    zero2 = set(zero_params(plan, TrainingState.ZERO2))
    assert sfb and zero2 and not sfb & zero2
    assert zero2 == {p for b in plan.buckets() if b.kind == "reduce_scatter" for p in b.params}
