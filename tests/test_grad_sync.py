"""Gradient buckets (instruction_set.sync) and their overlap with the backward pass
(runtime.grad_sync): the order and caps of the buckets, buckets launched from the backward
pass (not after it), every expected gradient arriving by its hook, and a failed bucket named."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetsynth.instruction_set.cluster import load_cluster
from hetsynth import capture_model
from hetsynth.instruction_set.plan import Plan
from hetsynth.instruction_set.sync import assign_buckets, first_uses, gradient_sync
from hetsynth.planner import baselines
from hetsynth.planner.planner import make_plan
from hetsynth.planner.problem import Restrictions
from hetsynth.runtime.config import TrainConfig

CLUSTER = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "local-emulated.toml"


def dp_plan(ref: str, devices: int, cap: int) -> Plan:
    cluster = load_cluster(CLUSTER).first(devices)
    graph = capture_model(ref)
    plan = make_plan(graph, cluster, ratios=baselines.even(cluster), restrictions=baselines.DP,
                     progress=False, with_baselines=False)
    return plan.model_copy(update={"gradient_sync": gradient_sync(graph, plan.instructions, plan.shards, cap)})


def test_buckets_follow_reverse_first_use_within_the_cap() -> None:
    plan = dp_plan("gpt:tiny", 2, 4096)
    uses = first_uses(plan.graph, plan.instructions)
    order = [p for b in plan.gradient_sync.buckets for p in b.params]
    positions = [uses[p][0] for p in order]
    assert positions == sorted(positions, reverse=True)
    syncs = [i.tensor for i in plan.instructions if i.kind == "all_reduce" and i.phase == "backward"]
    assert sorted(order) == sorted(syncs)
    for b in plan.gradient_sync.buckets:  # within the cap unless one parameter alone is larger
        assert b.nbytes <= 4096 or len(b.params) == 1
    assert len(plan.gradient_sync.buckets) > 2
    whole = assign_buckets(plan.graph, plan.instructions, plan.shards, 2**40)
    assert len(whole) == 1 and whole[0].nbytes == sum(b.nbytes for b in plan.gradient_sync.buckets)
    ddp = assign_buckets(plan.graph, plan.instructions, plan.shards, 2**40, 4096)  # DDP's shape: small first
    assert [len(b.params) for b in ddp] == [len(plan.gradient_sync.buckets[0].params), len(order) - len(ddp[0].params)]
    assert ddp[0] == plan.gradient_sync.buckets[0]
    tail = assign_buckets(plan.graph, plan.instructions, plan.shards, 2**40, 4096, 4096)  # and a small last one
    assert len(tail) == 3 and tail[0] == ddp[0] and tail[-1] == plan.gradient_sync.buckets[-1].model_copy(
        update={"index": 2})
    assert [p for b in tail for p in b.params] == order


def test_plan_with_buckets_missing_a_gradient_is_refused() -> None:
    plan = dp_plan("gpt:tiny", 2, 4096)
    first, *rest = plan.gradient_sync.buckets
    broken = plan.gradient_sync.model_copy(update={"buckets": (first.model_copy(update={"params": first.params[1:]}),
                                                               *rest)})
    with pytest.raises(ValueError, match="gradient buckets hold"):
        Plan.model_validate(plan.model_dump() | {"gradient_sync": broken.model_dump()})


def sync_worker(rank: int, world: int, plan: Plan, steps: int) -> list:
    import torch.distributed as dist

    from hetsynth.runtime.groups import Groups
    from hetsynth.runtime.train import setup, train_step

    trainer = setup(plan, Groups.create(plan.mesh, rank, world=dist.group.WORLD), TrainConfig(steps=steps))
    return [(log.phases["backward"] + log.phases["forward"], log.buckets)
            for log in (train_step(trainer, s) for s in range(steps))]


def test_buckets_launch_during_the_backward_pass(pools) -> None:
    plan = dp_plan("gpt:tiny,num_layers=4", 2, 8192)
    assert len(plan.gradient_sync.buckets) >= 3
    for steps in pools.get(2).run(sync_worker, plan, 3, timeout_s=300):
        for forward_backward_s, buckets in steps[1:]:
            assert not any(b.late for b in buckets)
            assert [b.index for b in buckets] == sorted(b.index for b in buckets)
            # the first bucket goes out while the backward still runs
            assert buckets[0].launched_s < forward_backward_s


def test_two_level_plan_gets_every_expected_gradient(pools) -> None:
    """GPT on 2 x 2 devices, data parallel across nodes and tensor parallel inside them
    (cross-node buckets of node-split weights, a row-parallel bias only one rank of a node
    adds): no bucket is launched late after the first step."""
    graph = capture_model("gpt:tiny")
    force = {n.name: layout for n in graph.calls if n.target == "aten.linear.default"
             for part, layout in (("ffn.fc1", "S0|S2"), ("ffn.fc2", "S0|P")) if part in n.module_path}
    plan = make_plan(graph, load_cluster(CLUSTER), ratios=[0.4, 0.3, 0.2, 0.1], progress=False,
                     restrictions=Restrictions(force=force), with_baselines=False)
    assert {b.axis for b in plan.buckets()} >= {"outer"}
    for steps in pools.get(4).run(sync_worker, plan, 2, timeout_s=300):
        assert not any(b.late for b in steps[1][1])


def test_cost_model_counts_the_runtime_stages() -> None:
    """The cost model's messages per bucket (instruction_set.sync.SYNC_MESSAGES, each charged
    the measured per-message CPU) are the stages the runtime issues."""
    from hetsynth.instruction_set.sync import SYNC_MESSAGES
    from hetsynth.runtime.grad_sync import STAGES

    assert {v: len(s) for v, s in STAGES.items()} == SYNC_MESSAGES


class _FutureLessWork:
    """A work like gloo's reduce_scatter: no future, complete only once waited."""

    def __init__(self) -> None:
        self.waits = 0

    def get_future(self):
        raise RuntimeError("Work::getFuture not implemented.")

    def is_completed(self) -> bool:
        return False

    def wait(self) -> bool:
        self.waits += 1
        return True


def test_a_futureless_stage_is_waited_once_and_then_done() -> None:
    from hetsynth.runtime.grad_sync import Pending

    work = _FutureLessWork()
    pending = Pending(work)
    pending.then(lambda _: pytest.fail("a work without a future has no callback"))
    assert not pending.done()
    pending.wait()
    pending.wait()  # the hook path and finish() may both ask: gloo's work is waited once
    assert work.waits == 1 and pending.done()


def test_a_stage_with_a_future_chains_its_callback() -> None:
    import torch

    from hetsynth.runtime.grad_sync import Pending

    class Work:
        def __init__(self) -> None:
            self.future = torch.futures.Future()

        def get_future(self):
            return self.future

    work, seen = Work(), []
    pending = Pending(work)
    pending.then(seen.append)
    assert not pending.done() and not seen
    work.future.set_result(None)  # completion runs the callback that issues the next stage
    assert pending.done() and len(seen) == 1


def stages_worker(rank: int, world: int) -> list:
    """Every stage of every variant issued on a 2 x 2 mesh: whether its work gives a future
    that completes without being waited, and the sum it ends with."""
    import time

    import torch
    import torch.distributed as dist

    from hetsynth.cost_models.comm import comm_mesh
    from hetsynth.runtime.grad_sync import STAGES, Pending
    from hetsynth.runtime.groups import Groups

    groups = Groups.create(comm_mesh(load_cluster(CLUSTER)), rank, world=dist.group.WORLD)
    out = []
    for variant, stages in STAGES.items():
        flat = torch.arange(7, dtype=torch.float64) + rank  # not a multiple of the node size
        state = None
        for s, (axis, issue) in enumerate(stages):
            work, state = issue(flat, state, groups.group(axis or "all"))
            pending, deadline = Pending(work), time.monotonic() + 30
            while pending.future is not None and not pending.done() and time.monotonic() < deadline:
                time.sleep(0.001)
            out.append((variant, s, pending.future is not None and pending.done()))
            pending.wait()
        expected = sum(torch.arange(7, dtype=torch.float64) + r for r in range(world))
        out.append((variant, "sum", float((state[:7] - expected).abs().max())))
    return out


def test_every_stage_completes_without_being_waited(pools) -> None:
    """A stage whose work the hooks cannot see complete (gloo's reduce_scatter: no future,
    complete only once waited) would hold its bucket's later stages until the step waits,
    after the backward: every stage the runtime issues has a future that completes alone."""
    for rows in pools.get(4).run(stages_worker, timeout_s=120):
        assert all(done for _, stage, done in rows if stage != "sum"), rows
        assert all(error == 0.0 for _, stage, error in rows if stage == "sum"), rows
