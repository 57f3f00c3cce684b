"""HuggingFace models in pipelines: their graphs at a micro-batch size are matched to the full
batch's by what each node computes (planner.graph_match), so that they get stage plans and run
them exactly.

HF's graphs at batch 1 leave out ops that are the identity there (Llama's and GPT-2's
`position_ids.expand(batch, -1)`, the labels' `.contiguous()` copy) and number the rest otherwise,
so that the captures at two sizes cannot be compared node by node.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hetsynth import capture_model
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.instruction_set.graph import Node, ReferenceGraph, TensorMeta
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.instruction_set.schedule import Schedule
from hetsynth.planner import pipeline as pipeline_module
from hetsynth.planner.graph_match import MicroGraphMismatch, aligned
from hetsynth.planner.microbatch import capture_at, classify, micro_graphs
from hetsynth.planner.pipeline import block_starts, make_pipeline_plan
from hetsynth.planner.planner import make_plan
from hetsynth.runtime.config import TrainConfig
from hetsynth.runtime.train import plan_reference

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = load_cluster(ROOT / "configs" / "clusters" / "local-emulated.toml")
LLAMA = "hf:llama,batch_size=4,seq_len=8,dtype=float64"


@pytest.mark.slow
def test_llama_graph_at_batch_one_is_matched_to_the_full_batch() -> None:
    spec = parse_model_ref(LLAMA)
    full, small = capture_at(spec, 4), capture_at(spec, 1)
    assert [(n.name, n.target) for n in full.calls] != [(n.name, n.target) for n in small.calls]
    with pytest.raises(MicroGraphMismatch, match="differ beyond their sizes"):
        classify(full, small)  # not an AssertionError: a user-facing ValueError
    graphs, found = micro_graphs(spec, full, (2, 1, 1))
    for g in graphs.values():  # node for node (the statistics are inputs there)
        assert [(n.name, n.target) for n in g.nodes] == [
            (n.name, "" if n.name in found.statistics else n.target) for n in full.nodes]
        assert g.loss == full.loss
    assert found.coupled == () and found.statistics  # the loss's count of labels is a statistic


def _graph(ops: list[tuple[str, str, tuple[int, ...]]], batch: int) -> ReferenceGraph:
    """x (batch, 4) -> a chain of unary ops, summed to the loss."""
    nodes = [Node(name="x", op="input", outputs=(TensorMeta(shape=(batch, 4), dtype="float32"),))]
    prev = "x"
    for name, target, shape in ops:
        nodes.append(Node(name=name, op="call", target=target, args=({"ref": prev},), inputs=(prev,),
                          outputs=(TensorMeta(shape=shape, dtype="float32"),)))
        prev = name
    nodes.append(Node(name="loss", op="call", target="aten.sum.default", args=({"ref": prev},), inputs=(prev,),
                      outputs=(TensorMeta(shape=(), dtype="float32"),)))
    return ReferenceGraph(model_ref="toy", nodes=tuple(nodes), loss="loss")


def test_a_copy_left_out_is_matched_and_another_op_is_named() -> None:
    full = _graph([("clone", "aten.clone.default", (8, 4)), ("relu", "aten.relu.default", (8, 4))], 8)
    small = _graph([("relu_1", "aten.relu.default", (2, 4))], 2)
    out = aligned(full, small, 8, 2)
    assert [n.name for n in out.calls] == ["clone", "relu", "loss"]
    assert out.node("relu").inputs == ("clone",) and out.node("relu").out.shape == (2, 4)
    other = _graph([("neg", "aten.neg.default", (2, 4))], 2)
    with pytest.raises(MicroGraphMismatch, match=r"no counterpart of the full batch's \(8\) relu = aten.relu"):
        aligned(full, other, 8, 2)


WIDTH = 8
# float64 everywhere (HF asks for float32 in RMSNorm, rotary embeddings and the loss):
# instruction_set.precision, as `run --check`'s twin
CONFIG = TrainConfig(steps=2, optimizer="adamw", lr=1e-2, max_grad_norm=1.0, dtype="float64")


def _train(rank: int, world: int, plan, config: TrainConfig) -> tuple:
    import torch.distributed as dist
    from hetsynth.runtime.pipeline.trainer import local_parameters, setup, train_step

    trainer = setup(plan, rank, config, world=dist.group.WORLD)
    return [train_step(trainer, step) for step in range(config.steps)], local_parameters(trainer)


@pytest.fixture(scope="module")
def llama_plan():
    """2 stages on ranks {0,1} | {2,3}, micro-batches of one sample (2 and 1 would need one program
    for both sizes: the stage programs shard dims that are 1 at batch 1)."""
    graph = capture_model(LLAMA)
    spmd = make_plan(graph, CLUSTER, ratios=[1.0] * 4, width=WIDTH, progress=False, with_baselines=False)
    cut, n = block_starts(graph)[len(block_starts(graph)) // 2], len(graph.calls)
    return make_pipeline_plan(spmd, parse_model_ref(LLAMA), [(range(0, 2), (0, cut)), (range(2, 4), (cut, n))],
                              num_micro=4, ratios=[[0.6, 0.4], [0.5, 0.5]], width=WIDTH)


@pytest.mark.timeout(300)
def test_llama_pipeline_with_a_micro_batch_of_one_trains_exactly(pools, llama_plan) -> None:
    """Loss and reassembled parameters as one device's, in float64."""
    from hetsynth.runtime.pipeline.trainer import assemble

    assert llama_plan.pipeline.micro_batches == (1, 1, 1, 1) and not llama_plan.pipeline.coupled
    results = pools.get(4).run(_train, llama_plan, CONFIG, timeout_s=240)
    losses, expected = plan_reference(llama_plan, CONFIG)
    for got, want in zip(results[0][0], losses):
        assert abs(got - want) <= 1e-9 * abs(want), (got, want)
    params = assemble(llama_plan, [r[1] for r in results])
    assert params
    for name, value in params.items():
        assert float((value - expected[name]).abs().max()) <= 1e-8, name


@pytest.mark.slow
def test_the_fastest_schedule_that_fits_is_chosen(llama_plan, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPipe (all M micro-batches in flight) predicted fastest but over memory: the fastest
    schedule that fits is taken instead (Llama at the 8B shape on hap-paper: GPipe 16.1 of 16 GiB
    on its last stage, eager-1F1B 3.6)."""
    times = {str(Schedule.GPIPE): 1.0, str(Schedule.EAGER_1F1B): 2.0, str(Schedule.ONE_F_ONE_B): 3.0}
    p = llama_plan.pipeline
    plan = llama_plan.model_copy(update={"pipeline": p.model_copy(update={
        "predicted": p.predicted.model_copy(update={"schedules": times})})})
    memory = lambda s: [(9.0 if s.pipeline.schedule is Schedule.GPIPE else 1.0, 4.0, 1)]  # noqa: E731
    monkeypatch.setattr(pipeline_module, "stage_memory", memory)
    assert pipeline_module._scheduled(plan, None).pipeline.schedule is Schedule.EAGER_1F1B
    assert pipeline_module._scheduled(plan, Schedule.GPIPE).pipeline.schedule is Schedule.GPIPE  # as asked
