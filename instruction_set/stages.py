"""A pipeline stage's share of the reference graph, as a reference graph of its own.

`stage_graph(graph, calls)` keeps the call nodes `graph.calls[calls]` and what they read:
- parameters, buffers and data inputs they read are kept as they are;
- a tensor an earlier stage computes from data alone (`input_only`: no parameter in its
  ancestry, such as GPT's positions or BERT's extended mask) is recomputed here: its producing
  calls are kept, so that it never crosses a boundary;
- any other tensor an earlier stage computes is a BOUNDARY INPUT: an `input` node of the same
  name and metadata (its value arrives from that stage, runtime.pipeline).
The stage's BOUNDARY OUTPUTS are its tensors that later stages read (input-only ones excepted).
A stage other than the last has no loss; its graph gets one that the search can treat as the
real one, `stage_loss = sum(sum(o) for o in outputs)`, so that every output stays live to the
end of the program in some layout. The runtime reads the outputs in the layouts the program
holds them and never differentiates the stand-in loss: only the boundary gradients drive the
stage's backward pass.
"""

from __future__ import annotations

from typing import Iterable

from hetsynth.instruction_set.graph import Node, ReferenceGraph, TensorMeta

STAGE_LOSS = "stage_loss"


def input_only(graph: ReferenceGraph) -> frozenset[str]:
    """Tensors whose ancestry holds no parameter: computable from the data (and constants)."""
    out: set[str] = set()
    for node in graph.nodes:
        if node.op in ("input", "buffer") or (node.op == "call" and all(i in out for i in node.inputs)):
            out.add(node.name)
    return frozenset(out)


def _recomputed(graph: ReferenceGraph, names: Iterable[str], cheap: frozenset[str]) -> set[str]:
    """The input-only calls that produce `names`, with their input-only call ancestors."""
    todo, out = [n for n in names if n in cheap and graph.node(n).op == "call"], set()
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out.add(name)
        todo += [i for i in graph.node(name).inputs if graph.node(i).op == "call"]
    return out


def boundary_outputs(graph: ReferenceGraph, start: int, stop: int) -> tuple[str, ...]:
    """Tensors of calls[start:stop] that calls after `stop` read (input-only ones excepted)."""
    calls, cheap = graph.calls, input_only(graph)
    own = {n.name for n in calls[start:stop]}
    later = {i for n in calls[stop:] for i in n.inputs}
    return tuple(n.name for n in calls[start:stop] if n.name in later and n.name in own and n.name not in cheap)


def stage_graph(graph: ReferenceGraph, start: int, stop: int) -> ReferenceGraph:
    """The reference graph of the stage computing graph.calls[start:stop] (module docstring)."""
    calls, cheap = graph.calls, input_only(graph)
    own = {n.name for n in calls[start:stop]}
    read = {i for n in calls[start:stop] for i in n.inputs}
    earlier = {n.name for n in calls[:start]}
    again = _recomputed(graph, read & earlier, cheap)
    keep = own | again
    wanted = read | {i for n in again for i in graph.node(n).inputs}
    nodes: list[Node] = []
    for node in graph.nodes:
        if node.name in keep or (node.op != "call" and node.name in wanted):
            nodes.append(node)
        elif node.name in wanted and node.name in earlier:
            nodes.append(Node(name=node.name, op="input", outputs=node.outputs, module_path=node.module_path,
                              source=node.source))
    last = stop >= len(calls)
    loss = graph.loss
    if not last:
        nodes += _stand_in_loss(graph, boundary_outputs(graph, start, stop))
        loss = STAGE_LOSS
    return graph.model_copy(update={"nodes": tuple(nodes), "loss": loss})


def _stand_in_loss(graph: ReferenceGraph, outputs: tuple[str, ...]) -> list[Node]:
    """sum(o) per floating-point output, added up; the last node is named STAGE_LOSS."""
    floats = [o for o in outputs if graph.node(o).out.is_float]
    if not floats:
        raise ValueError(f"a stage boundary passes no floating-point tensor ({list(outputs)}): cut elsewhere")
    dtype = graph.node(floats[0]).out.dtype
    nodes, total = [], None
    for i, name in enumerate(floats):
        meta = graph.node(name).out
        nodes.append(Node(name=f"stage_sum_{i}", op="call", target="aten.sum.default", args=({"ref": name},),
                          inputs=(name,), outputs=(TensorMeta(shape=(), dtype=meta.dtype, requires_grad=True),)))
        if total is not None:
            nodes.append(Node(name=f"stage_add_{i}", op="call", target="aten.add.Tensor",
                              args=({"ref": total}, {"ref": nodes[-1].name}), inputs=(total, nodes[-1].name),
                              outputs=(TensorMeta(shape=(), dtype=dtype, requires_grad=True),)))
        total = nodes[-1].name
    nodes[-1] = nodes[-1].model_copy(update={"name": STAGE_LOSS})
    return nodes
