"""Which rows of the global batch each rank reads: the contract between the data loader and a
parallelized module.

For a plan with global batch B and forward inputs x_1..x_n (the graph's `input` nodes, in the
forward's order), rank r reads, of input x_i, the rows

    R_i(r) = union over the layouts L in which r's program reads x_i of rows(L, r)

where rows(Replicate, r) = [0, B) and rows(Shard(0) with lengths l, r) = [o_r, o_r + l_r),
o_r the offset of r's shard (uneven lengths, zero-length legal). A rank that does not read x_i
at all (a pipeline stage that never sees the labels) has R_i(r) empty. The loader
(hetsynth.data) reads exactly the union of R_i(r) over i from the dataset, and the module's
forward takes, for each input, the rows R_i(r) in increasing order (`local_rows` maps each
layout's rows to positions in them).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from hetsynth.instruction_set.layouts import Layout
from hetsynth.instruction_set.mesh import Mesh
from hetsynth.instruction_set.pipeline import PipelineStage
from hetsynth.instruction_set.plan import Plan, PlanShape
from hetsynth.instruction_set.shards import MeshLayout


def input_names(plan: Plan) -> list[str]:
    """The forward's inputs, in order (the graph's `input` nodes)."""
    return [n.name for n in plan.graph.nodes if n.op == "input"]


def layout_rows(plan: Plan, mesh: Mesh, tensor: str, layout: Layout, rank: int, batch: int) -> range:
    """The rows of a global batch of `batch` rows that `rank` holds of `tensor` in `layout`."""
    if not layout.is_shard or 0 not in plan.lengths(tensor, layout):
        return range(batch)
    lengths = plan.lengths(tensor, layout)[0]
    start = MeshLayout(mesh, layout).offset(lengths, 0, rank)
    return range(start, start + lengths[mesh.index(rank)])


def spmd_reads(plan: Plan, rank: int) -> dict[str, list[range]]:
    """input -> the row ranges of each layout an SPMD program reads it in."""
    batch = plan.model.batch_size
    reads: dict[str, list[range]] = {name: [] for name in input_names(plan)}
    for ins in plan.instructions:
        if ins.kind == "input":
            reads[ins.tensor].append(layout_rows(plan, plan.mesh, ins.tensor, ins.layout, rank, batch))
    return reads


def pipeline_reads(plan: Plan, rank: int) -> dict[str, list[range]]:
    """input -> the row ranges a pipeline rank reads it in: every micro-batch's rows of its
    stage's layouts, and the whole batch for inputs of batch statistics (planner.microbatch)."""
    assert plan.pipeline is not None
    pipeline, batch = plan.pipeline, plan.model.batch_size
    reads: dict[str, list[range]] = {name: [] for name in input_names(plan)}
    stage = pipeline.stage_of(rank)
    mesh = stage_mesh_of(stage)
    base = 0
    for b in pipeline.micro_batches:
        sub = stage.plans[b]
        for ins in sub.instructions:
            if ins.kind == "input" and ins.tensor in reads and ins.tensor not in _received(plan):
                r = layout_rows(sub, mesh, ins.tensor, ins.layout, rank, b)
                reads[ins.tensor].append(range(base + r.start, base + r.stop))
        base += b
    for name in _statistics_inputs(plan, stage_statistics(plan, stage)):
        reads[name].append(range(batch))
    return reads


def stage_statistics(plan: Plan, stage: PipelineStage) -> list[str]:
    """The pipeline's batch statistics that a stage's programs read (as their inputs)."""
    assert plan.pipeline is not None
    read = {ins.tensor for sub in stage.plans.values() for ins in sub.instructions if ins.kind == "input"}
    return [s for s in plan.pipeline.statistics if s in read]


def stage_mesh_of(stage: PipelineStage) -> Mesh:
    """The mesh of a pipeline stage: its plans' mesh shape, placed at its first rank."""
    mesh = next(iter(stage.plans.values())).mesh
    return Mesh(mesh.num_nodes, mesh.per_node, mesh.two_level, stage.first_rank)


def _received(plan: Plan) -> set[str]:
    """Tensors a stage receives from another (stage boundaries), not read from the data."""
    assert plan.pipeline is not None
    return {b.tensor for b in plan.pipeline.boundaries}


def _statistics_inputs(plan: Plan, statistics: Sequence[str]) -> set[str]:
    """The graph inputs the batch statistics `statistics` read (the whole global batch)."""
    graph, inputs = plan.graph, set(input_names(plan))
    todo, seen, found = list(statistics), set(), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in inputs:
            found.add(n)
        elif graph.node(n).op == "call":
            todo += list(graph.node(n).inputs)
    return found


def input_rows(plan: Plan, rank: int) -> list[list[int]]:
    """R_i(rank) for every forward input, in order (module docstring): sorted global rows."""
    reads = pipeline_reads(plan, rank) if plan.shape is PlanShape.PIPELINE else spmd_reads(plan, rank)
    return [sorted({r for rows in reads[name] for r in rows}) for name in input_names(plan)]


def local_rows(rows: Sequence[int], wanted: range) -> slice | list[int]:
    """Positions of the global rows `wanted` inside a rank's sorted `rows`: a slice when they
    are contiguous there (always, for one layout per input), else a list of positions."""
    if not wanted:
        return slice(0, 0)
    at = {r: i for i, r in enumerate(rows)}
    missing = [r for r in wanted if r not in at]
    assert not missing, f"rows {missing[:4]} are not among this rank's rows"
    first = at[wanted.start]
    if at[wanted[-1]] - first == len(wanted) - 1:
        return slice(first, first + len(wanted))
    return [at[r] for r in wanted]


def check_rows(plan: Plan, rows: Sequence[Sequence[int]], rank: int, inputs: Sequence[Any]) -> None:
    """ValueError unless `inputs` are this rank's rows `rows[i]` of each of the plan's inputs
    (input_rows'), in the plan's order: the count, then each shape, named with both."""
    nodes = [n for n in plan.graph.nodes if n.op == "input"]
    if len(inputs) != len(nodes):
        raise ValueError(f"the plan's forward takes {len(nodes)} inputs "
                         f"({', '.join(n.name for n in nodes)}), {len(inputs)} were given")
    for node, mine, x in zip(nodes, rows, inputs):
        want = (len(mine), *node.out.shape[1:])
        if not torch.is_tensor(x) or tuple(x.shape) != want:
            got = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
            raise ValueError(f"input {node.name!r} on rank {rank}: shape {got}, this rank's rows of "
                             f"the plan's {tuple(node.out.shape)} are {want} ({len(mine)} of "
                             f"{node.out.shape[0]} rows; hetsynth.data.loader gives them)")


__all__ = ["check_rows", "input_names", "input_rows", "layout_rows", "local_rows", "pipeline_reads", "spmd_reads", "stage_mesh_of",
           "stage_statistics"]
