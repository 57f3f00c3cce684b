"""Structural signatures of graph nodes, so repeated layers share search transitions.

Two nodes with equal signatures (same op, arguments, shapes and FLOPs; inputs of the same
kind, metadata, dim-class units, batch dims, liveness and forced layout) have the same rules,
costs and storage options, so their transitions differ only in tensor names. A transition is
stored with the node's distinct input tensors replaced by `#0`, `#1`, ... and its output by
`#out`, and renamed back for the node at hand.
"""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache
from typing import Any, Sequence

from hetsynth.instruction_set.graph import Node
from hetsynth.planner.problem import Problem
from hetsynth.planner.transitions import Emit, Fact, Move

OUT = "#out"


class Signatures:
    def __init__(self, pb: Problem, dead_after: Sequence[tuple[str, ...]]) -> None:
        self.pb, self.dead_after = pb, dead_after
        self._sig: dict[int, tuple] = {}
        self._names: dict[int, tuple[str, ...]] = {}

    def names(self, k: int) -> tuple[str, ...]:
        """The node's distinct input tensors in argument order, then the node itself."""
        if k not in self._names:
            node = self.pb.order[k]
            self._names[k] = tuple(dict.fromkeys(node.inputs)) + (node.name,)
        return self._names[k]

    def of(self, k: int) -> tuple:
        if k not in self._sig:
            self._sig[k] = self._signature(k)
        return self._sig[k]

    def _tensor(self, tensor: str, k: int) -> tuple:
        pb = self.pb
        node = pb.graph.node(tensor)
        meta = node.outputs[0]
        dims = []
        for d in range(len(meta.shape)):
            cls = pb.classes.classes[pb.classes.class_of[(tensor, d)]]
            dims.append((cls.root_size, cls.unit, pb.classes.class_id(tensor, d) in pb.batch_classes))
        single_use = node.op == "param" and pb.graph.consumers.get(tensor) == (pb.order[k].name,)
        return (node.op, meta.shape, meta.dtype, meta.requires_grad, node.multi_output,
                tensor in self.dead_after[k], single_use, tuple(dims), pb.restrictions.force.get(tensor))

    def _signature(self, k: int) -> tuple:
        node = self.pb.order[k]
        names = self.names(k)
        position = {t: f"#{i}" for i, t in enumerate(names[:-1])}
        return (node.target, canonical_args(node, position), node.flops_fwd, node.flops_bwd, node.fallback,
                tuple(self._tensor(t, k) for t in names), self.pb.graph.expert_loads.get(node.name))


def canonical_args(node: Node, position: dict[str, Any]) -> str:
    """The node's arguments as JSON, each tensor reference `{"ref": name}` replaced by
    `position[name]` (in lists and at the top level of args and kwargs)."""

    def canon(value: Any) -> Any:
        if isinstance(value, list):
            return [canon(v) for v in value]
        if isinstance(value, dict) and "ref" in value:
            return {"ref": position[value["ref"]]}
        return value

    return json.dumps([canon(list(node.args)), {k: canon(v) for k, v in node.kwargs.items()}], sort_keys=True,
                      default=str)


def canonical_facts(facts: frozenset[Fact], names: tuple[str, ...]) -> frozenset[Fact]:
    token = _tokens(names)
    return frozenset((token[t], layout) for t, layout in facts)


@lru_cache(maxsize=1 << 16)
def _tokens(names: tuple[str, ...]) -> dict[str, str]:
    """Tensor -> token (read only: shared by every call with these names)."""
    token = {t: f"#{i}" for i, t in enumerate(names[:-1])}
    token[names[-1]] = OUT
    return token


@lru_cache(maxsize=1 << 16)
def _back(names: tuple[str, ...]) -> dict[str, str]:
    """Token -> tensor (read only)."""
    return {v: k for k, v in _tokens(names).items()}


def canonical_move(move: Move, names: tuple[str, ...]) -> Move:
    token = _tokens(names)
    rename = lambda name: token.get(name, name)
    instructions = tuple(dataclasses.replace(e, tensor=rename(e.tensor), node=rename(e.node))
                         for e in move.resolved())
    added = frozenset((rename(t), layout) for t, layout in move.added)
    return Move(move.rule_index, move.cost, added, instructions)


def actual_facts(facts: frozenset[Fact], names: tuple[str, ...]) -> frozenset[Fact]:
    """Canonical facts renamed back to the node's tensors."""
    back = _back(names)
    return frozenset((back.get(t, t), layout) for t, layout in facts)


def instantiate(move: Move, names: tuple[str, ...]) -> Move:
    """The canonical move for this node: facts renamed now, instructions when resolved."""
    return Move(move.rule_index, move.cost, actual_facts(move.added, names), move.instructions, _back(names))


__all__ = ["Emit", "Signatures", "canonical_args", "actual_facts", "canonical_facts", "canonical_move", "instantiate"]
