"""Micro-batches with exact single-device semantics.

The global batch of step s is samples [sB, (s+1)B). M micro-batches split it in order; the first
`B mod M` get ceil(B/M) samples and the rest floor(B/M) (`micro_batch_sizes`: B=8, M=3 gives
3, 3, 2). Each micro-batch runs the model's graph captured at its own size (`micro_graphs`),
rebuilt on the full batch's nodes by what each computes (planner.graph_match): the captures at
two sizes may differ in order, names and identity ops left out, the rebuilt graphs only in
shapes and in arguments that scale with the batch.

The loss contract: the micro-batches' losses must SUM to the single-device loss, so that the
gradients autograd accumulates over them are the whole batch's. Comparing the graph at B with the
graph at b < B (`classify`) finds every BATCH REDUCTION (a node whose inputs change with the batch
size and whose outputs do not):
- an input-only one (its ancestry holds no parameter: `count = sum(valid)` in `total / count`)
  is a STATISTIC: the micro-batch graphs read it as an input (`with_statistics`), and the runtime
  computes it from the whole global batch, so each micro-batch's loss is its share
  `total_m / count`, and the shares add up to the loss exactly;
- a parameter-dependent `sum` is linear in the samples if every path from it to the loss only
  adds, subtracts, reshapes, or multiplies/divides by input-only values: its micro-batch parts
  add up;
- anything else couples the micro-batches (a mean over the batch whose product is taken, as
  MoE's auxiliary loss; BatchNorm's batch statistics) and so does a constant that depends on
  the batch size (BatchNorm's n/(n-1)): such graphs are pipelined with one micro-batch (M = 1,
  exact), and `MicroBatching.coupled` says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from hetsynth.instruction_set.graph import Node, ReferenceGraph
from hetsynth.instruction_set.models import ModelSpec, with_overrides
from hetsynth.instruction_set.stages import input_only
from hetsynth.planner.capture import capture_spec
from hetsynth.planner.graph_match import MicroGraphMismatch, aligned

# ops a batch sum's path to the loss may take and stay linear in the samples
_LINEAR = {"aten.add.Tensor", "aten.sub.Tensor", "aten.neg.default", "aten.view.default", "aten.reshape.default",
           "aten.squeeze.dim", "aten.unsqueeze.default", "aten._to_copy.default", "aten.sum.default",
           "aten.sum.dim_IntList", "aten.clone.default"}
_SCALING = {"aten.mul.Tensor", "aten.div.Tensor"}


@dataclass(frozen=True)
class MicroBatching:
    statistics: tuple[str, ...]   # input-only batch reductions, read from the whole batch
    coupled: tuple[str, ...]      # why micro-batches would change the loss (empty: separable)


def micro_batch_sizes(batch: int, num_micro: int) -> tuple[int, ...]:
    if not 1 <= num_micro <= batch:
        raise ValueError(f"{num_micro} micro-batches for a batch of {batch}: choose 1..{batch}")
    q, r = divmod(batch, num_micro)
    return tuple(q + 1 if m < r else q for m in range(num_micro))


def micro_offsets(sizes: Sequence[int]) -> tuple[int, ...]:
    return tuple(sum(sizes[:m]) for m in range(len(sizes)))


def capture_at(spec: ModelSpec, batch: int) -> ReferenceGraph:
    return capture_spec(with_overrides(spec, batch_size=batch))


def _varies(full: ReferenceGraph, small: ReferenceGraph, name: str) -> bool:
    return full.node(name).outputs != small.node(name).outputs


def _where(node: Node) -> str:
    return f"{node.name} = {node.target} at {node.module_path or '<top>'}" + (f" ({node.source})" if node.source else "")


def classify(full: ReferenceGraph, small: ReferenceGraph) -> MicroBatching:
    """Statistics and couplings of a graph (module docstring), from captures at two batch sizes."""
    cheap, stats, coupled = input_only(full), [], []
    _check_aligned(full, small)
    for node, other in zip(full.calls, small.calls):
        if _varies(full, small, node.name):
            continue
        if node.args != other.args and node.name not in cheap:
            coupled.append(f"a constant depends on the batch size: {_where(node)}")
        elif any(_varies(full, small, i) for i in node.inputs):
            if node.name in cheap:
                stats.append(node.name)
            elif not node.target.startswith("aten.sum.") or not _linear_to_loss(full, node.name, cheap):
                coupled.append(f"a batch reduction that does not add up over micro-batches: {_where(node)}")
    return MicroBatching(tuple(stats), tuple(coupled))


def _check_aligned(full: ReferenceGraph, small: ReferenceGraph) -> None:
    pairs = [(a, b) for a, b in zip(full.calls, small.calls) if (a.name, a.target) != (b.name, b.target)]
    if pairs or len(full.calls) != len(small.calls):
        first = f"{_where(pairs[0][0])} against {_where(pairs[0][1])}" if pairs else "their lengths"
        raise MicroGraphMismatch(f"the graphs of {full.model_ref} differ beyond their sizes ({len(full.calls)} and "
                                 f"{len(small.calls)} ops); first: {first} (planner.graph_match.aligned matches them)")


def _linear_to_loss(graph: ReferenceGraph, name: str, cheap: frozenset[str]) -> bool:
    todo, seen = [name], set()
    while todo:
        t = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        for c in graph.consumers[t]:
            node = graph.node(c)
            others = [i for i in node.inputs if i != t]
            if node.target in _SCALING and all(i in cheap for i in others) and node.inputs[0] == t:
                todo.append(c)
            elif node.target in _LINEAR:
                todo.append(c)
            else:
                return False
    return True


def with_statistics(graph: ReferenceGraph, statistics: Sequence[str]) -> ReferenceGraph:
    """The graph with each statistic node turned into an input of the same name and shape."""
    names = set(statistics)
    nodes = tuple(Node(name=n.name, op="input", outputs=n.outputs, module_path=n.module_path, source=n.source)
                  if n.name in names else n for n in graph.nodes)
    return graph.model_copy(update={"nodes": nodes})


def statistic_closure(graph: ReferenceGraph, statistics: Sequence[str]) -> tuple[str, ...]:
    """The call nodes that compute the statistics, in graph order."""
    todo, need = list(statistics), set()
    while todo:
        t = todo.pop()
        if t in need or graph.node(t).op != "call":
            continue
        need.add(t)
        todo += list(graph.node(t).inputs)
    return tuple(n.name for n in graph.calls if n.name in need)


MeasureAt = Callable[[ReferenceGraph, int], ReferenceGraph]  # (graph at size b, b) -> its ops timed


def micro_graphs(spec: ModelSpec, full: ReferenceGraph, sizes: Sequence[int],
                 measure: MeasureAt | None = None) -> tuple[dict[int, ReferenceGraph], MicroBatching]:
    """The graph at each distinct micro-batch size, statistics turned into inputs; raises
    ValueError naming the coupling when the graph cannot be split into these micro-batches.
    `measure` times each size's ops (as `full`'s were: profiling.measured.measure_at), so a
    micro-batch is charged what it takes at its own size, not a share of the whole batch's."""
    distinct = sorted(set(sizes))
    batch = sum(sizes)
    if distinct == [batch]:
        return {batch: full}, MicroBatching((), ())
    graphs = {b: capture_at(spec, b) for b in distinct}
    if measure is not None:
        graphs = {b: measure(g, b) for b, g in graphs.items()}
    try:
        graphs = {b: aligned(full, g, batch, b) for b, g in graphs.items()}
    except MicroGraphMismatch as err:
        raise MicroGraphMismatch(f"{len(sizes)} micro-batches of {spec.ref}: {err}; pipeline it with one "
                                 f"micro-batch") from err
    if full.expert_loads:  # the user's routing loads hold per token, whatever the batch
        graphs = {b: g.model_copy(update={"expert_loads": {n: v for n, v in full.expert_loads.items()
                                                           if n in g.by_name}}) for b, g in graphs.items()}
    found = classify(full, graphs[distinct[0]])
    if found.coupled:
        raise ValueError(f"{len(sizes)} micro-batches would change the loss of {spec.ref}: {found.coupled[0]}; "
                         f"pipeline it with one micro-batch")
    return {b: with_statistics(g, found.statistics) for b, g in graphs.items()}, found
