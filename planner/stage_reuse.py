"""Stage programs reused between stages of the same structure (planner.pipeline).

A pipeline's stages are planned one by one, and the stage dynamic programme's candidates share
stages: gpt:paper with 48 layers on hap-paper's eight nodes gives 8- and 7-stage candidates
whose middle stages are the same blocks on the same kind of node. Two stage problems are the
same when

- the stage graphs are equal up to names (`structure`: each node's op, arguments, shapes,
  FLOPs, saved tensors, measured time and position in its block, with tensors named by their
  position in the graph and blocks by their order of appearance),
- the sub-clusters are equal up to device and node names (`anonymous`), and
- the planning options (ratios, width, precision) are equal.

The search, the ratio LP and the memory fitting then see one problem under two namings, so the
plan found for the first is the second's renamed (up to ties the search breaks by name). A hit
renames the first plan's program by position (tensors, nodes, recomputed blocks) and costs it
on the stage's own graph and sub-cluster (planner.pipeline.program_at), so its shard lengths,
prediction and gradient buckets are computed for it, not copied.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Hashable

from hetsynth.instruction_set.blocks import block_of
from hetsynth.instruction_set.cluster import ClusterSpec
from hetsynth.instruction_set.graph import Node, ReferenceGraph
from hetsynth.instruction_set.plan import Plan
from hetsynth.planner.signature import canonical_args


def _blocks(graph: ReferenceGraph) -> dict[str, str]:
    """Block name -> its order of first appearance ("#0", "#1", ...)."""
    out: dict[str, str] = {}
    for node in graph.nodes:
        block = block_of(node)
        if block is not None and block not in out:
            out[block] = f"#{len(out)}"
    return out


def _node_key(node: Node, position: dict[str, int], blocks: dict[str, str], graph: ReferenceGraph) -> tuple:
    block = block_of(node)
    path = node.module_path if block is None else blocks[block] + node.module_path[len(block):]
    return (node.op, node.target, canonical_args(node, position), tuple(position[t] for t in node.inputs),
            tuple(m.model_dump_json() for m in node.outputs), node.multi_output, node.flops_fwd, node.flops_bwd,
            path, json.dumps(node.value), node.fallback, node.measured_s,
            None if node.saved is None else tuple(s.model_dump_json() for s in node.saved),
            graph.expert_loads.get(node.name))


def structure(graph: ReferenceGraph) -> tuple:
    """The graph with names replaced by positions (module docstring)."""
    position = {n.name: i for i, n in enumerate(graph.nodes)}
    blocks = _blocks(graph)
    # update times, scales: the planner reads them (expert loads: per node, in its key)
    whole = graph.model_dump_json(exclude={"nodes", "model_ref", "loss", "expert_loads"})
    return (position[graph.loss], whole, tuple(_node_key(n, position, blocks, graph) for n in graph.nodes))


def anonymous(cluster: ClusterSpec) -> str:
    """The cluster spec with its name dropped and its devices and nodes named by position."""
    names = {d.name: f"device{i}" for i, d in enumerate(cluster.devices)}
    names |= {n.name: f"node{i}" for i, n in enumerate(cluster.nodes)}

    def rename(value: Any) -> Any:
        if isinstance(value, str):
            return names.get(value, value)
        if isinstance(value, list):
            return [rename(v) for v in value]
        if isinstance(value, dict):
            return {names.get(k, k): rename(v) for k, v in value.items()}
        return value

    return json.dumps(rename(cluster.model_dump(mode="json", exclude={"name", "description"})), sort_keys=True)


def renamed(plan: Plan, graph: ReferenceGraph) -> Plan:
    """`plan`'s program with its tensors, nodes and recomputed blocks renamed to those at the
    same positions of `graph` (a graph of the same structure)."""
    names = {a.name: b.name for a, b in zip(plan.graph.nodes, graph.nodes)}
    blocks = dict(zip(_blocks(plan.graph), _blocks(graph)))
    program = tuple(i.model_copy(update={"tensor": names.get(i.tensor, i.tensor), "node": names.get(i.node, i.node),
                                         "recompute": blocks.get(i.recompute, i.recompute)})
                    for i in plan.instructions)
    return plan.model_copy(update={"instructions": program, "graph": graph})


class StagePrograms:
    """Stage plans by (structure, anonymous sub-cluster, options): `plan` synthesizes on a
    miss and renames on a hit; `hits` counts the searches saved."""

    def __init__(self) -> None:
        self._plans: dict[tuple, Plan] = {}
        self.hits = 0

    def plan(self, graph: ReferenceGraph, cluster: ClusterSpec, options: Hashable,
             synthesize: Callable[[], Plan], cost: Callable[[ReferenceGraph, ClusterSpec, Plan], Plan]) -> Plan:
        """The stage's plan: `synthesize()` the first time this problem is seen; after that
        the first plan renamed for `graph` and costed there by `cost(graph, cluster, plan)`."""
        key = (structure(graph), anonymous(cluster), options)
        first = self._plans.get(key)
        if first is None:
            made = self._plans[key] = synthesize()
            return made
        self.hits += 1
        reused = first.synthesis.model_copy(update={"seconds": 0.0, "search_seconds": 0.0, "lp_seconds": 0.0,
                                                    "states_expanded": 0, "rounds": 0})
        return cost(graph, cluster, renamed(first, graph).model_copy(update={"cluster": cluster, "synthesis": reused}))


__all__ = ["StagePrograms", "anonymous", "renamed", "structure"]
