"""Recomputed blocks in a rank program: activation checkpointing of a plan's units.

The instructions of a recomputed unit (instruction_set.blocks: `Instruction.recompute`) are
emitted into a graph of their own, a `torch.fx.GraphModule` called through

    torch.utils.checkpoint.checkpoint(body, *inputs, use_reentrant=False, early_stop=False)

so the forward keeps only the unit's inputs (the values it reads from before it, parameters
included: they are passed in, so the body owns no state) and the backward runs the body again
before going through it. `early_stop=False` is required: non-reentrant checkpoint otherwise
stops the recomputation once every tensor it needs is rebuilt, and a collective after that
point (a tensor-parallel all-reduce at the block's end) would run on the ranks whose last
needed tensor lies after it and not on the others: a hang. With it, every rank runs the whole
body again, collectives in the same order. Dropout draws the same numbers again (the RNG
state is preserved, checkpoint's default).

The body returns the values the program reads after the unit (by a scan of the later
instructions); the main graph takes them out with `getitem`.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from hetsynth.instruction_set.blocks import Unit, reads
from hetsynth.instruction_set.graph import ReferenceGraph
from hetsynth.instruction_set.layouts import P, Layout
from hetsynth.instruction_set.program import Instruction

Key = tuple[str, Layout]


class Recompute(nn.Module):
    """Runs `body` under non-reentrant checkpoint (module docstring)."""

    def __init__(self, body: fx.GraphModule) -> None:
        super().__init__()
        self.body = body

    def forward(self, *inputs: Any) -> Any:
        return checkpoint(self.body, *inputs, use_reentrant=False, early_stop=False, preserve_rng_state=True)


class UnitEnv(dict):
    """The emitter's values inside a unit: a value from outside becomes a placeholder of the
    body (once), and the outer node is recorded as the call's argument."""

    def __init__(self, outer: dict, body: fx.Graph) -> None:
        super().__init__()
        self.outer, self.body = outer, body
        self.args: list[fx.Node] = []
        self.defined: list[Key] = []

    def __missing__(self, key: Key) -> fx.Node:
        node = self.body.placeholder(f"in_{key[0]}")
        self.args.append(self.outer[key])
        super().__setitem__(key, node)
        return node

    def __setitem__(self, key: Key, value: fx.Node) -> None:
        self.defined.append(key)
        super().__setitem__(key, value)


def read_after(graph: ReferenceGraph, program: Sequence[Instruction], last: int) -> set[Key]:
    """Values read by the instructions from `last` on, and the loss the program returns."""
    out = {(graph.loss, P)}
    for ins in program[last:]:
        out.update(reads(graph, ins))
    return out


def emit_unit(emitter: Any, unit: Unit, emit_one: Callable[[Any, Instruction], None]) -> fx.Node:
    """Emit `unit`'s instructions into a checkpointed body called from the main graph; returns
    the call's node. Parameters and buffers stay in the main graph (the body reads them as
    inputs)."""
    program = emitter.plan.instructions
    outer, outer_env = emitter.graph, emitter.env
    body = fx.Graph()
    env = UnitEnv(outer_env, body)
    for ins in program[unit.first:unit.last]:
        inside = ins.kind not in ("param", "buffer")
        emitter.graph, emitter.env = (body, env) if inside else (outer, outer_env)
        emit_one(emitter, ins)
    emitter.graph, emitter.env = outer, outer_env
    later = read_after(emitter.plan.graph, program, unit.last)
    keys = [k for k in dict.fromkeys(env.defined) if k in later]
    body.output(tuple(env[k] for k in keys))
    name = f"recompute_{unit.name.replace('.', '_')}"
    emitter.root.add_module(name, Recompute(fx.GraphModule(emitter.root, body, class_name="RecomputedBlock")))
    call = outer.call_module(name, tuple(env.args))
    for j, key in enumerate(keys):
        outer_env[key] = outer.call_function(operator.getitem, (call, j))
    return call


__all__ = ["Recompute", "UnitEnv", "emit_unit", "read_after"]
