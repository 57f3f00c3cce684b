"""Per-rank programs: a Plan and a rank become a torch.fx.GraphModule computing that rank's
local loss (a Partial: the ranks' losses sum to the global loss).

Every rank builds its own program from the same Plan; nobody re-runs the search. The plan's
instructions are emitted in order:

  param / buffer   the rank's slice of the tensor (its storage layout), held by the module
                   (a ZeRO-3 parameter: its rows only, gathered by a GatherParamModule call at
                   each compute op that reads it; runtime.zero3)
  ZeRO-3 chain     the gathers, a RegatherPoint on the outputs of each op that reads gathered
                   parameters, and a ChainEnd on the loss, linked by a token in program order
                   (recomputed blocks return their last token), so that their backwards, which
                   reduce-scatter and gather again, run in one order on every rank whatever
                   each rank's graph (runtime.zero3)
  input            a placeholder: the rank's rows of the batch (or all of it, for R)
  compute          the op on local shards, via instruction_set.local.emit_local (the code path
                   the single-process rule tests check), or an SFB linear
  collectives      a call to a Conversion module (runtime.conversions)
  ag_matmul /      a linear fused with its all-gather / reduce-scatter, one FusedLinear call
  matmul_rs        (runtime.fused_ops); ag_matmul's gathered input is its second result
  recomputed block the instructions of a unit the plan recomputes, as one checkpointed call
                   (runtime.recompute)
  cross-entropy    its decomposed pieces, where a rank holds whole rows of the logits, as one
                   F.cross_entropy call (runtime.peephole)
  buffer update    `copy_(buffer, new)` is not run in the forward: the program returns the
                   new value, and the trainer writes it into the buffer after the backward
                   pass (an in-place write during the forward would invalidate tensors saved
                   for the backward)

The program returns `(loss, *new buffer values)`, in the order of `RankProgram.updates`.
Each kind's emitter is registered in EMITTERS (instruction_set.kinds); a plan with a kind that
has none is refused before anything is emitted, naming the kind and what is registered.

Parameters are nn.Parameters of the GraphModule, so its `parameters()` are exactly the local
parameters to optimise; `RankProgram.params` tells how each synchronises its gradient.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx, nn

from hetsynth.instruction_set.blocks import recomputed_units
from hetsynth.instruction_set.graph import Node
from hetsynth.instruction_set.interpret import constant
from hetsynth.instruction_set.kinds import Category, Implementations, MissingImplementation, Phase, kinds
from hetsynth.instruction_set.layouts import P, R, Layout
from hetsynth.instruction_set.local import (MAY_DRAW, LocalContext, decoded, dropped_inputs, emit_local, local_kinds,
                                            window_starts)
from hetsynth.instruction_set.mesh import Mesh
from hetsynth.instruction_set.plan import Plan
from hetsynth.instruction_set.program import Instruction
from hetsynth.instruction_set.rules.state import BUFFER_UPDATE
from hetsynth.instruction_set.shards import MeshLayout
from hetsynth.instruction_set.training_state import TrainingState
from hetsynth.runtime.collectives import Span
from hetsynth.runtime.conversions import make_conversion, span
from hetsynth.runtime.draws import Draws
from hetsynth.runtime.experts import DispatchedExperts
from hetsynth.runtime.fused_ops import FusedLinear
from hetsynth.runtime.mixed_precision import gradient_wire, wire_dtype
from hetsynth.runtime.groups import Groups
from hetsynth.runtime.peephole import fuse_cross_entropy
from hetsynth.runtime.recompute import emit_unit
from hetsynth.runtime.sfb import SFBLinearModule
from hetsynth.runtime.zero3 import GatherParamModule, ParamGathers, RegatherPointModule, chain_end, chain_start


CHAIN = ("zero3_chain", R)  # the env's key of the ZeRO-3 chain's latest token (runtime.zero3)


@dataclass(frozen=True)
class LocalParam:
    name: str            # attribute of the GraphModule (the graph's parameter node name)
    fqn: str             # the model's parameter name
    layout: Layout       # storage layout
    sync: Instruction | None  # backward all_reduce, or None (sharded, or SFB)


@dataclass
class RankProgram:
    module: fx.GraphModule
    params: list[LocalParam]
    inputs: list[tuple[str, Layout]]  # (graph input name, layout) in placeholder order
    updates: list[str] = field(default_factory=list)  # buffer attributes the outputs after the loss update
    outputs: list[tuple[str, Layout]] = field(default_factory=list)  # returned after the updates (pipeline boundaries)
    ends: list[tuple[int, str]] = field(default_factory=list)  # (instruction index, name of its last fx node)
    # (instruction index, fx node that now does its work): instructions a peephole merged away
    merged: list[tuple[int, str]] = field(default_factory=list)
    gathers: ParamGathers | None = None  # the ZeRO-3 parameters' gathers (runtime.zero3), if any


class FxBuilder:
    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph

    def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict, name: str | None = None) -> fx.Node:
        return self.graph.create_node("call_function", fn, tuple(args), kwargs, name=name)


def local_shape(plan: Plan, tensor: str, layout: Layout, member: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The local shape on the mesh member at index `member` (the rank, on a whole-cluster mesh)."""
    out = list(shape)
    if layout.is_shard:
        for dim, lengths in plan.lengths(tensor, layout).items():
            out[dim] = lengths[member]
    return tuple(out)


def local_slice(plan: Plan, tensor: str, layout: Layout, rank: int, full: torch.Tensor,
                mesh: Mesh | None = None) -> torch.Tensor:
    """This rank's part of a whole tensor in `layout` (params, buffers, data), on `mesh` (the
    plan's, or a pipeline stage's sub-mesh of global ranks)."""
    if not layout.is_shard:
        return full
    mesh = mesh or plan.mesh
    placed, member = MeshLayout(mesh, layout), mesh.index(rank)
    for dim, lengths in plan.lengths(tensor, layout).items():
        full = full.narrow(dim, placed.offset(lengths, dim, rank), lengths[member])
    return full


class _Emitter:
    def __init__(self, plan: Plan, groups: Groups, state: Mapping[str, torch.Tensor] | None,
                 device: torch.device, outputs: Sequence[tuple[str, Layout]] = (), draws: Draws | None = None) -> None:
        self.plan, self.groups, self.state, self.device = plan, groups, state, device
        self.outputs = list(outputs)
        self.rank = groups.rank
        self.member = groups.mesh.index(groups.rank)  # index into per-member shard lengths
        self.graph = fx.Graph()
        self.root = nn.Module()
        self.draws = draws
        if draws is not None:
            self.root.add_module("draws", draws)
        self.env: dict[tuple[str, Layout], fx.Node] = {}
        self.params: list[LocalParam] = []
        self.inputs: list[tuple[str, Layout]] = []
        self.updates: list[tuple[str, fx.Node]] = []
        self.sfb = {i.node: i for i in plan.instructions if i.kind == "sfb"}
        self.syncs = {i.tensor: i for i in plan.instructions if i.kind == "all_reduce" and i.phase == "backward"}
        self.zero3: set[str] = set()   # ZeRO-3 parameters: rows, gathered at each use
        self.gathers = ParamGathers()
        self.chain_tail: dict[fx.Graph, fx.Node] = {}  # per graph (main, recomputed bodies): its latest token

    def _local_value(self, node: Node, layout: Layout) -> torch.Tensor:
        meta = node.out
        if self.state is None:
            shape = local_shape(self.plan, node.name, layout, self.member, meta.shape)
            return torch.empty(shape, dtype=getattr(torch, meta.dtype), device="meta")
        whole = constant(node) if node.value is not None else self.state[node.fqn]
        part = local_slice(self.plan, node.name, layout, self.rank, whole, self.groups.mesh)
        return part.detach().clone().to(self.device)

    def storage(self, ins: Instruction) -> None:
        node = self.plan.graph.node(ins.tensor)
        value = self._local_value(node, ins.layout)
        if ins.state == TrainingState.ZERO3:  # only this rank's rows, gathered at each use (runtime.zero3)
            value = self._zero3_rows(node.name, value)
        if node.op == "param":
            self.root.register_parameter(node.name, nn.Parameter(value, requires_grad=node.out.requires_grad))
            self.params.append(LocalParam(node.name, node.fqn, ins.layout, self.syncs.get(node.name)))
        else:
            self.root.register_buffer(node.name, value)
        self.env[(ins.tensor, ins.layout)] = self.graph.get_attr(node.name)

    def _zero3_rows(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        shards = self.plan.state_shards
        assert shards is not None, f"zero3 parameter {name} without state_shards"
        rows = shards.rows[name]
        whole_span = self.groups.span("all")
        span = Span(whole_span.group, whole_span.members, whole_span.index, 0, rows)
        self.root.add_module(f"gather_{name}", GatherParamModule(span, shards.variant, shards.scatter_variant,
                                                                 self.gathers, gradient_wire(self.plan)))
        if not self.zero3:
            self.root.add_module("zero3_regather", RegatherPointModule(self.gathers))
            self.env[CHAIN] = self.graph.call_function(chain_start, (self.device,))
        self.zero3.add(name)
        return whole.narrow(0, sum(rows[:whole_span.index]), rows[whole_span.index]).clone()

    def _read(self, tensor: str, layout: Layout) -> fx.Node:
        """A value for a compute op: a ZeRO-3 parameter gathered for this use."""
        value = self.env[(tensor, layout)]
        if tensor in self.zero3:
            call = self.graph.call_module(f"gather_{tensor}", (value, self.env[CHAIN]))
            self._link(self.graph.call_function(operator.getitem, (call, 1)))
            return self.graph.call_function(operator.getitem, (call, 0))
        return value

    def _link(self, token: fx.Node) -> None:
        self.env[CHAIN] = self.chain_tail[self.graph] = token

    def _regather_point(self, out: fx.Node) -> fx.Node:
        """`out` (an op's value) through a RegatherPoint, the next link of the chain."""
        call = self.graph.call_module("zero3_regather", (self.env[CHAIN], out))
        self._link(self.graph.call_function(operator.getitem, (call, 0)))
        return self.graph.call_function(operator.getitem, (call, 1))

    def _unit_returns_token(self, call: fx.Node) -> None:
        """A recomputed block's call returns its body's last token too (after the values it
        returns), and the main graph's chain goes on from it."""
        body = self.root.get_submodule(call.target).body
        tail = self.chain_tail.get(body.graph)
        if tail is None:
            return
        out = next(n for n in reversed(body.graph.nodes) if n.op == "output")
        returned = tuple(out.args[0])
        out.args = ((*returned, tail),)
        body.recompile()
        self._link(self.graph.call_function(operator.getitem, (call, len(returned))))

    def _end_chain(self) -> None:
        """The program's loss through ChainEnd (after the peephole rewrites, which read the loss)."""
        out = next(n for n in reversed(self.graph.nodes) if n.op == "output")
        loss, *rest = out.args[0]
        with self.graph.inserting_before(out):
            end = self.graph.call_function(chain_end, (loss, self.env[CHAIN]))
        out.args = ((end, *rest),)

    def data_input(self, ins: Instruction) -> None:
        self.inputs.append((ins.tensor, ins.layout))
        self.env[(ins.tensor, ins.layout)] = self.graph.placeholder(ins.tensor)

    def compute(self, ins: Instruction) -> None:
        node = self.plan.graph.node(ins.node)
        values = [self._read(t, l) for t, l in zip(node.inputs, ins.inputs)]
        if node.target == BUFFER_UPDATE:
            self.updates.append((node.inputs[0], values[1]))
            out = values[0]
        elif ins.node in self.sfb:
            out = self._sfb(ins, node, values)
        elif "experts_dispatched" in local_kinds(ins.local):
            out = self._dispatched(ins, node, values)
        elif self.draws is not None and self.draws.holds(node.name):  # a pipeline's: made whole once a step
            out = self._drawn(node, ins, values)
        else:
            out = emit_local(node, ins.local, values, self._context(node, ins), FxBuilder(self.graph))
        if self.zero3 & set(node.inputs):
            out = self._regather_point(out)
        self.env[(ins.node, ins.layout)] = out

    def _drawn(self, node: Node, ins: Instruction, values: list[fx.Node]) -> fx.Node:
        """A random op of a pipeline stage: its window of the step's whole draw (runtime.draws)."""
        shape = node.outputs[0].shape
        self.draws.fold(node.name, shape)  # DrawShapeError while building, not at the first step
        a, k = decoded(node, values, self.device)
        return self.graph.call_module("draws", (node.name, shape, window_starts(node, self._context(node, ins)), *a), k)

    def _context(self, node: Node, ins: Instruction) -> LocalContext:
        mesh = self.groups.mesh
        shapes = tuple(local_shape(self.plan, node.name, ins.layout, self.member, m.shape) for m in node.outputs)
        offsets = {}
        if local_kinds(ins.local) & {"gather_sharded", "embedding_sharded"}:
            offsets[0] = self._lookup_offset(node, ins)
        if "experts_sharded" in local_kinds(ins.local):  # the rank's first expert (instruction_set.experts_op)
            offsets[3] = self._offset(node.inputs[3], ins.inputs[3], 0)
        starts = ({d: self._offset(node.name, ins.layout, d) for d in self.plan.lengths(node.name, ins.layout)}
                  if node.target in MAY_DRAW and ins.layout.is_shard else {})  # the window of a whole draw (instruction_set.local)
        return LocalContext(shapes, self.device, dropped_inputs(ins.local, mesh.node(self.rank), mesh.local(self.rank)),
                            offsets, _global_count(self.plan, node), starts)

    def _offset(self, tensor: str, layout: Layout, dim: int) -> int:
        """Start of this rank's shard of `tensor` along `dim` under `layout`."""
        return MeshLayout(self.groups.mesh, layout).offset(self.plan.lengths(tensor, layout)[dim], dim, self.rank)

    def _lookup_offset(self, node: Node, ins: Instruction) -> int:
        """Start of this rank's rows along the dim a sharded lookup reads (the gather dim, or
        the embedding's vocabulary dim), whatever other dims the layout splits (S0|S1)."""
        t, layout = node.inputs[0], ins.inputs[0]
        ndim = len(self.plan.graph.node(t).out.shape)
        dim = 0 if node.target == "aten.embedding.default" else node.args[1] % ndim
        return MeshLayout(self.groups.mesh, layout).offset(self.plan.lengths(t, layout)[dim], dim, self.rank)

    def _dispatched(self, ins: Instruction, node: Node, values: list[fx.Node]) -> fx.Node:
        """Routed experts with tokens and experts split (runtime.experts), among the ranks the
        expert weights split over: the node's under a two-level layout (R|S0), else all."""
        layout = ins.inputs[3]
        s = span(self.plan, self.groups, node.inputs[3], layout, "inner" if layout.is_two_level else "all")
        name = f"experts_{node.name}"
        self.root.add_module(name, DispatchedExperts(s, node.args[5], self.device))
        return self.graph.call_module(name, tuple(values[:5]))

    def _sfb(self, ins: Instruction, node: Node, values: list[fx.Node]) -> fx.Node:
        sfb = self.sfb[ins.node]
        x, layout = node.inputs[0], ins.inputs[0]
        tokens = _token_counts(self.plan, x, layout)
        s = span(self.plan, self.groups, x, layout, "all")
        s = type(s)(s.group, s.members, s.index, 0, tuple(tokens))
        name = f"sfb_{node.name}"
        self.root.add_module(name, SFBLinearModule(s, sfb.variant, gradient_wire(self.plan)))
        return self.graph.call_module(name, tuple(values))

    def conversion(self, ins: Instruction) -> None:
        if ins.tensor in self.zero3:
            raise ValueError(f"cannot run this plan: zero3 parameter {ins.tensor} feeds a {ins.kind}; a ZeRO-3 "
                             f"parameter must be read by compute ops only")
        name = f"{ins.kind}_{ins.tensor}"
        while hasattr(self.root, name):
            name += "_"
        self.root.add_module(name, make_conversion(self.plan, self.groups, ins))
        self.env[(ins.tensor, ins.layout)] = self.graph.call_module(name, (self.env[(ins.tensor, ins.src)],))

    def fused(self, ins: Instruction) -> None:
        """ag_matmul / matmul_rs: the linear and its collective as one FusedLinear call
        (runtime.fused_ops); ag_matmul also makes the gathered input available."""
        node = self.plan.graph.node(ins.node)
        if self.zero3 & set(node.inputs):
            raise ValueError(f"cannot run this plan: zero3 parameter(s) {sorted(self.zero3 & set(node.inputs))} feed "
                             f"the fused {ins.kind} {node.name}; a ZeRO-3 parameter must be read by plain compute ops")
        x = node.inputs[0]
        values = [self.env[(x, ins.src)] if i == 0 and ins.kind == "ag_matmul" else self.env[(t, l)]
                  for i, (t, l) in enumerate(zip(node.inputs, ins.inputs))]
        tensor, layout = (x, ins.src) if ins.kind == "ag_matmul" else (ins.tensor, ins.layout)
        name = f"{ins.kind}_{node.name}"
        fused = FusedLinear(ins.kind, span(self.plan, self.groups, tensor, layout, ins.axis), ins.variant)
        fused.wire = wire_dtype(self.plan, x)
        self.root.add_module(name, fused)
        out = self.graph.call_module(name, tuple(values))
        if ins.kind == "ag_matmul":
            self.env[(x, ins.inputs[0])] = self.graph.call_function(operator.getitem, (out, 1))
            out = self.graph.call_function(operator.getitem, (out, 0))
        self.env[(ins.tensor, ins.layout)] = out

    def emit(self) -> RankProgram:
        missing = EMITTERS.missing((i.kind, i.phase, None) for i in self.plan.instructions)
        if missing:
            raise MissingImplementation(
                "cannot run this plan: no codegen for instruction kind " + ", ".join(
                    f"{k!r} ({p})" for k, p, _ in missing) + f"; codegen exists for: {EMITTERS.registered()}")
        ends = []
        units = {u.first: u for u in recomputed_units(self.plan.instructions)}
        index = 0
        while index < len(self.plan.instructions):
            if index in units:  # a recomputed block: one checkpointed call (runtime.recompute)
                unit = units[index]
                call = emit_unit(self, unit, _emit_one)
                self._unit_returns_token(call)
                ends.append((unit.last - 1, call.name))
                index = unit.last
                continue
            ins = self.plan.instructions[index]
            before = len(self.graph.nodes)
            _emit_one(self, ins)
            if len(self.graph.nodes) > before and ins.kind not in ("param", "buffer", "input"):
                ends.append((index, next(iter(reversed(self.graph.nodes))).name))
            index += 1
        self.graph.output((self.env[(self.plan.graph.loss, P)], *[v for _, v in self.updates],
                           *[self.env[out] for out in self.outputs]))
        into = fuse_cross_entropy(self.graph)
        if self.zero3:
            self._end_chain()
        module = fx.GraphModule(self.root, self.graph, class_name=f"Rank{self.rank}Program")
        return RankProgram(module, self.params, self.inputs, [b for b, _ in self.updates],
                           ends=[(k, n) for k, n in ends if n not in into], outputs=self.outputs,
                           merged=[(k, into[n]) for k, n in ends if n in into],
                           gathers=self.gathers if self.zero3 else None)


def _emit_one(emitter: _Emitter, ins: Instruction) -> None:
    EMITTERS.get(ins.kind, phase=ins.phase)(emitter, ins)


def _built_with_its_linear(emitter: _Emitter, ins: Instruction) -> None:
    """sfb (backward): nothing to emit; `compute` builds the linear as an SFBLinearModule,
    whose backward gathers the factors (runtime.sfb)."""


def _recorded_on_its_param(emitter: _Emitter, ins: Instruction) -> None:
    """all_reduce (backward): nothing to emit; `storage` records it as the parameter's
    LocalParam.sync, which runtime.grad_sync runs in the plan's buckets during the backward pass."""


EMITTERS: Implementations[Callable[[_Emitter, Instruction], None]] = Implementations("codegen")
EMITTERS.implements("param", "buffer")(_Emitter.storage)
EMITTERS.register("input", _Emitter.data_input)
EMITTERS.register("compute", _Emitter.compute)
EMITTERS.implements(*(k.name for k in kinds(Category.COMMUNICATION) + kinds(Category.LOCAL)))(_Emitter.conversion)
EMITTERS.implements("ag_matmul", "matmul_rs")(_Emitter.fused)
EMITTERS.register("sfb", _built_with_its_linear, phase=Phase.BACKWARD)
EMITTERS.register("all_reduce", _recorded_on_its_param, phase=Phase.BACKWARD)


def _global_count(plan: Plan, node: Node) -> int:
    """Elements a global mean averages (for mean_global)."""
    if "mean" not in node.target:
        return 1
    shape = plan.graph.node(node.inputs[0]).out.shape
    dims = node.args[1] if len(node.args) > 1 and node.args[1] else list(range(len(shape)))
    count = 1
    for d in dims:
        count *= shape[d % len(shape)] if shape else 1
    return count


def _token_counts(plan: Plan, x: str, layout: Layout) -> list[int]:
    shape = plan.graph.node(x).out.shape
    return [int(torch.Size(local_shape(plan, x, layout, r, shape)[:-1]).numel())
            for r in range(plan.cluster.num_devices)]


def build_rank_program(plan: Plan, groups: Groups, *, state: Mapping[str, torch.Tensor] | None = None,
                       device: torch.device | str = "cpu", outputs: Sequence[tuple[str, Layout]] = (),
                       draws: Draws | None = None) -> RankProgram:
    """The per-rank program. `state` maps the model's parameter and buffer names to whole
    tensors (sliced here); without it, parameters are meta tensors (for reading the code).
    `outputs`: (tensor, layout) pairs the program also returns, after the buffer updates (a
    pipeline stage's boundary outputs, in the layouts it computes them). `draws`: a pipeline
    stage's random draws, made once a step (runtime.draws); without it, a random op draws its
    whole tensor where it runs (instruction_set.local.draw_whole)."""
    return _Emitter(plan, groups, state, torch.device(device), outputs, draws).emit()
