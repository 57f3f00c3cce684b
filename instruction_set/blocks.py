"""Recompute units: the repeated blocks of a model, as ranges of a program's instructions.

A block is an element of a `ModuleList` / `Sequential`: the prefix of an op's module path up
to its first integer component (`blocks.3` of `blocks.3.attn.query`, `model.layers.0` of a
HuggingFace decoder layer). In a program (a plan's instruction list) the unit of block b is
the range [first, last) from its first to its last compute instruction; it can be recomputed
(activation checkpointing: only the values it reads from before the range are kept for the
backward pass, the range runs again in the backward) when

- the range holds nothing but b's compute instructions, forward layout conversions,
  parameter storage and backward gradient syncs (no op of another block or of no block, no
  data input, no SFB weight: its gathers live in the gradient sync), and no buffer update;
- at least two of its ops save tensors for backward (a single layer gains nothing: VGG's
  `features.k` are not units).

An instruction of a recomputed unit carries the block's name in `Instruction.recompute`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hetsynth.instruction_set.graph import Node, ReferenceGraph
from hetsynth.instruction_set.kinds import Category, Phase
from hetsynth.instruction_set.layouts import Layout
from hetsynth.instruction_set.kinds import kind as instruction_kind
from hetsynth.instruction_set.program import Instruction
from hetsynth.instruction_set.rules.state import BUFFER_UPDATE


@dataclass(frozen=True)
class Unit:
    """Block `name` spans instructions [first, last) of a program."""

    name: str
    first: int
    last: int


def block_of(node: Node) -> str | None:
    """The block an op belongs to: its module path up to the first integer component."""
    parts = node.module_path.split(".") if node.module_path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return None


def _allowed(ins: Instruction, graph: ReferenceGraph, name: str) -> bool:
    if ins.kind == "compute":
        node = graph.node(ins.node)
        return block_of(node) == name and node.target != BUFFER_UPDATE
    if ins.kind == "param" or (ins.kind == "all_reduce" and ins.phase == Phase.BACKWARD):
        return True
    category = instruction_kind(ins.kind).category
    return category in (Category.COMMUNICATION, Category.LOCAL) and ins.phase == Phase.FORWARD


def recompute_units(graph: ReferenceGraph, program: Sequence[Instruction]) -> list[Unit]:
    """The program's units that can be recomputed, in program order (module docstring)."""
    spans: dict[str, list[int]] = {}
    for i, ins in enumerate(program):
        if ins.kind == "compute" and (name := block_of(graph.node(ins.node))) is not None:
            spans.setdefault(name, [i, i])[1] = i
    sfb = {i.node for i in program if i.kind == "sfb"}
    units = []
    for name, (first, last) in spans.items():
        inside = program[first:last + 1]
        saving = [i for i in inside if i.kind == "compute" and graph.node(i.node).saved]
        if (len(saving) >= 2 and all(_allowed(i, graph, name) for i in inside)
                and not any(i.kind == "compute" and i.node in sfb for i in inside)):
            units.append(Unit(name, first, last + 1))
    return units


def recomputed_units(program: Sequence[Instruction]) -> list[Unit]:
    """The units a program marks as recomputed (contiguous runs of one `recompute` name)."""
    units: list[Unit] = []
    for i, ins in enumerate(program):
        if not ins.recompute:
            continue
        if units and units[-1].name == ins.recompute and units[-1].last == i:
            units[-1] = Unit(ins.recompute, units[-1].first, i + 1)
        else:
            units.append(Unit(ins.recompute, i, i + 1))
    return units


def mark_recomputed(program: Sequence[Instruction], units: Sequence[Unit]) -> tuple[Instruction, ...]:
    """The program with exactly `units` marked recomputed."""
    name = {i: u.name for u in units for i in range(u.first, u.last)}
    return tuple(ins.model_copy(update={"recompute": name.get(i, "")}) if ins.recompute != name.get(i, "") else ins
                 for i, ins in enumerate(program))



def reads(graph: ReferenceGraph, ins: Instruction) -> list[tuple[str, Layout]]:
    """The values (tensor, layout) an instruction reads: an op's inputs for compute and a fused
    linear (`runs_op`; ag_matmul reads its first input in `src`, gathered under the matmul:
    `src_tensor`), else the layout `src` of `tensor` a layout change reads (none for storage)."""
    if ins.runs_op:
        inputs = graph.node(ins.node).inputs
        keys = list(zip(inputs, ins.inputs))
        if ins.kind == "ag_matmul":
            keys[0] = (ins.src_tensor(inputs), ins.src)
        return keys
    return [(ins.tensor, ins.src)] if ins.src is not None else []


def writes(graph: ReferenceGraph, ins: Instruction) -> list[tuple[str, Layout]]:
    """The values an instruction defines: its output, and ag_matmul's gathered input too."""
    if ins.kind == "ag_matmul":
        return [(ins.tensor, ins.layout), (ins.src_tensor(graph.node(ins.node).inputs), ins.inputs[0])]
    return [(ins.tensor, ins.layout)] if ins.runs_op or ins.src is not None else []

__all__ = ["Unit", "block_of", "mark_recomputed", "reads", "recompute_units", "recomputed_units", "writes"]
