"""ZeRO-3 with a rank of no compute rows (ratio 0.0) trains exactly as one device.

A rank whose shard of an op's output is empty runs `instruction_set.local.empty_result`
instead of the op: its graph saves no gathered parameter, so the saved-tensor hooks that
release them never fire there. Every rank must still issue the backward's regathers and
reduce-scatters, in the same order as the others (runtime.zero3's chain of links), or the
collectives mismatch and hang. Float64, 5 AdamW steps with clipping (test_parity's CONFIG):
the global loss of every step within 1e-9 relative, the reassembled parameters within 1e-8,
and every rank regathers as often as the others (and some). The same through
hetsynth.parallelize's ParallelModule (a user loop with no_sync accumulation), and with
every block recomputed (the recomputation, which gathers again, runs on every rank).
"""

from __future__ import annotations

import pytest

from hetsynth.instruction_set.blocks import mark_recomputed, recompute_units
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.instruction_set.plan import Plan
from hetsynth.instruction_set.training_state import TrainingState
from hetsynth.planner.planner import DP_SEED, with_zero
from hetsynth.runtime.config import TrainConfig
from hetsynth.runtime.input_rows import input_rows
from hetsynth.api import _forced_zero as forced_zero
from test_parity import CONFIG, check_results, make

# (model, compute ratios with a rank of none, state ratios: that rank holds rows of the state, or none)
CASES = [("bert:tiny,dtype=float64", [0.5, 0.3, 0.2, 0.0], [0.4, 0.3, 0.2, 0.1]),
         ("gpt:tiny,dtype=float64", [0.0, 0.6, 0.4, 0.0], [0.1, 0.4, 0.5, 0.0])]


def zero3_worker(rank: int, world: int, plan: Plan, config: TrainConfig) -> tuple:
    import torch.distributed as dist

    from hetsynth.runtime.groups import Groups
    from hetsynth.runtime.train import local_parameters, setup, train_step

    trainer = setup(plan, Groups.create(plan.mesh, rank, world=dist.group.WORLD), config)
    losses = [train_step(trainer, step).loss for step in range(config.steps)]
    return losses, local_parameters(trainer), trainer.program.gathers.regathers


def zero3_plan(ref: str, ratios: list[float], q: list[float], recompute: bool = False) -> Plan:
    plan = make(ref, ratios, DP_SEED)
    if recompute:
        units = recompute_units(plan.graph, plan.instructions)
        plan = plan.model_copy(update={"instructions": mark_recomputed(plan.instructions, units)})
    plan = with_zero(plan, q, TrainingState.ZERO3)
    assert any(i.kind == "param" and i.state == TrainingState.ZERO3 for i in plan.instructions)
    return plan


def check_exact(pools, plan: Plan) -> list[int]:
    """Train on the pool; losses and parameters as one device's. Returns each rank's regathers."""
    results = pools.get(plan.cluster.num_devices).run(zero3_worker, plan, CONFIG, timeout_s=300)
    check_results(plan, results)
    return [r[2] for r in results]


@pytest.mark.parametrize("ref, ratios, q", CASES)
def test_zero3_with_a_rank_of_no_rows_matches_single_device(pools, ref: str, ratios: list[float],
                                                             q: list[float]) -> None:
    plan = zero3_plan(ref, ratios, q)
    assert [len(input_rows(plan, r)[0]) for r, x in enumerate(ratios) if x == 0.0] == [0] * ratios.count(0.0)
    regathers = check_exact(pools, plan)
    assert regathers[0] > 0 and len(set(regathers)) == 1, regathers


def test_zero3_recomputed_blocks_with_a_rank_of_no_rows(pools) -> None:
    plan = zero3_plan("gpt:tiny,dtype=float64", [0.6, 0.4, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25], recompute=True)
    assert any(i.recompute for i in plan.instructions)
    check_exact(pools, plan)


def test_parallelize_zero3_with_a_rank_of_no_rows(pools) -> None:
    """hetsynth.parallelize's module over BERT under ZeRO-3 with a rank of no rows: the user
    loop (two param groups, LambdaLR, no_sync accumulation, clipping, an evaluation pass)."""
    parallelize = pytest.importorskip("test_parallelize")

    ref = "bert:tiny,dtype=float64"
    spec = parse_model_ref(ref)
    plan = forced_zero(make(ref, [0.5, 0.3, 0.2, 0.0], DP_SEED), 3)
    B = spec.batch_size
    batches = [list(spec.make_batch(range(i * B, (i + 1) * B), seed=0))
               for i in range(parallelize.STEPS * parallelize.MICRO)]
    parallelize.check(pools, plan, parallelize._ZooBuild(ref), batches)
