"""Transitions of the search: computing the next node under one of its rules.

A transition at node k picks a rule, then makes every input available in the layout the rule
needs, in the cheapest way:

- a layout the state already holds costs nothing;
- a graph input not used before is *stored*: a parameter as R (its gradient all-reduced in
  backward, or rebuilt by sufficient-factor broadcasting when the consumer is a batch-split
  linear and that is cheaper), or as S(d) (no gradient sync); a data input as S0 (each rank
  loads its rows) or R; a buffer as R. Each storage is a separate transition, since the
  stored layout stays available to later consumers;
- any other layout is converted from one the state holds, along the cheapest path of one or
  two collectives (Problem.conversion).

The output is added in the rule's output layout. `Move` records the instructions in order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import product

from hetsynth.instruction_set.graph import Node
from hetsynth.instruction_set.kinds import kind as instruction_kind
from hetsynth.instruction_set.layouts import P, R, S, Layout, Replicate, Shard
from hetsynth.instruction_set.program import Instruction
from hetsynth.instruction_set.rules import Rule
from hetsynth.planner.problem import Problem, Step, StorageClass
from hetsynth.planner.sfb import sfb_cost

Fact = tuple[str, Layout]


@dataclass(frozen=True, slots=True)
class Move:
    rule_index: int
    cost: float
    added: frozenset[Fact]
    instructions: tuple["Emit", ...]
    names: dict[str, str] | None = None  # tensor renaming of shared (canonical) instructions

    def resolved(self) -> tuple["Emit", ...]:
        if self.names is None:
            return self.instructions
        rename = lambda n: self.names.get(n, n)
        return tuple(dataclasses.replace(e, tensor=rename(e.tensor), node=rename(e.node))
                     for e in self.instructions)


@dataclass(frozen=True, slots=True)
class _Option:
    cost: float
    facts: tuple[Fact, ...]
    instructions: tuple["Emit", ...]


@dataclass(frozen=True, slots=True)
class Emit:
    """An instruction as the search records it (made into an Instruction for the plan)."""

    kind: str
    tensor: str
    layout: Layout
    src: Layout | None = None
    node: str = ""
    inputs: tuple[Layout, ...] = ()
    local: str = ""
    variant: str = ""
    phase: str = "forward"
    predicted_s: float = 0.0
    alternatives: tuple[tuple[str, float], ...] = ()
    axis: str = "all"

    def instruction(self) -> Instruction:
        fields = {k: getattr(self, k) for k in self.__slots__}
        fields["alternatives"] = dict(self.alternatives)
        return Instruction(**fields)


def _emit(**fields) -> Emit:
    if "alternatives" in fields:
        fields["alternatives"] = tuple(fields["alternatives"].items())
    return Emit(**fields)


def _conversion_instructions(tensor: str, steps: tuple[Step, ...]) -> tuple[Emit, ...]:
    return tuple(_emit(kind=s.kind, tensor=tensor, src=s.src, layout=s.dst, variant=s.variant,
                       predicted_s=s.cost_s, alternatives=dict(s.alternatives), axis=s.axis)
                 for s in steps)


def _convert(pb: Problem, tensor: str, have: set[Layout], want: Layout) -> _Option | None:
    memo = pb.memo.setdefault("convert", {})
    key = (tensor, frozenset(have), want)
    if key not in memo:
        memo[key] = _cheapest_conversion(pb, tensor, have, want)
    return memo[key]


def _cheapest_conversion(pb: Problem, tensor: str, have: set[Layout], want: Layout) -> _Option | None:
    paths = [(src, pb.conversion(tensor, src, want)) for src in sorted(have)]
    paths = [(src, p) for src, p in paths if p is not None]
    if not paths:
        return None
    src, steps = min(paths, key=lambda sp: sum(s.cost_s for s in sp[1]))
    return _Option(sum(s.cost_s for s in steps), tuple((tensor, s.dst) for s in steps),
                   _conversion_instructions(tensor, steps))


# -- storage of graph inputs ---------------------------------------------------------------

def _storage_layouts(pb: Problem, node: Node) -> list[Layout]:
    """Where a graph input may live: data by rows (S0, or S0|R on a two-level mesh) or whole;
    parameters whole, split over all devices (S<d>) or inside each node (R|S<d>). A restriction's
    input layout (the baselines' S0) binds floating-point data; integer inputs (token ids,
    labels: a few bytes a row) may also be loaded whole, so that what the loss needs of all of
    them (cross-entropy's count of valid labels) is known with no communication."""
    dims = pb.shardable_dims(node.name)
    two = pb.mesh.two_level
    if node.op == "buffer":
        layouts = [R]
    elif node.op == "input":
        layouts = _input_layouts(pb, node, two and 0 in dims, 0 in dims)
    else:
        layouts = [R] + [S(d) for d in dims] + ([Layout(Replicate(), Shard(d)) for d in dims] if two else [])
        layouts = _restrict_params(pb, node, layouts)
    forced = pb.restrictions.force.get(node.name)
    if forced is not None:
        layouts = [forced]
    return [l for l in layouts if pb.allowed(node.name, l)]


def _input_layouts(pb: Problem, node: Node, two_level: bool, by_rows: bool) -> list[Layout]:
    forced = pb.restrictions.input_layout
    if forced is not None and by_rows:  # an input without rows (a statistic's scalar) stays whole
        return [forced] + ([R] if not node.out.is_float and forced is not R else [])
    return [R] + ([S(0)] if by_rows else []) + ([Layout(Shard(0), Replicate())] if two_level else [])


def _restrict_params(pb: Problem, node: Node, layouts: list[Layout]) -> list[Layout]:
    allowed = pb.restrictions.param_layouts
    if allowed is not None:
        layouts = [l for l in layouts if StorageClass.of(l) in allowed]
    ndim_min = pb.restrictions.shard_params_with_dims
    if ndim_min is not None and len(node.out.shape) >= ndim_min:
        layouts = [l for l in layouts if l.is_shard] or layouts
    return layouts


def _grad_sync(pb: Problem, param: str, consumer: Node, rule: Rule | None) -> Emit:
    """Backward synchronisation of a replicated parameter: all-reduce, or SFB when cheaper
    (`rule` is the consumer's rule when it reads the parameter replicated, else None)."""
    memo = pb.memo.setdefault("grad_sync", {})
    key = (param, consumer.name, rule)
    if key not in memo:
        memo[key] = _choose_grad_sync(pb, param, consumer, rule)
    return memo[key]


def replica_sync(pb: Problem, param: str, layout: Layout) -> Emit | None:
    """Backward all-reduce over the axes along which a stored parameter is replicated:
    every device for R (bucketed, any variant), across nodes for R|S<d>, none for S<d>."""
    meta = pb.meta(param)
    if not meta.requires_grad or (layout.is_shard and not layout.is_two_level):
        return None
    nbytes, axis = (meta.nbytes, "all") if layout == R else (meta.nbytes * max(pb.shares(param, layout)), "outer")
    seconds = pb.comm.gradient_allreduce(nbytes, axis).at((1.0,) * pb.width)
    return _emit(kind="all_reduce", tensor=param, layout=layout, src=P, phase="backward",
                 variant=pb.comm.gradient_variant(nbytes, axis), predicted_s=seconds, axis=axis)


def _choose_grad_sync(pb: Problem, param: str, consumer: Node, rule: Rule | None) -> Emit:
    meta = pb.meta(param)
    allreduce = pb.comm.gradient_allreduce(meta.nbytes).at((1.0,) * pb.width)
    sfb = _sfb_cost(pb, param, consumer, rule) if rule is not None else None
    options = {"all_reduce": allreduce} | ({"sfb": sfb[0]} if sfb is not None else {})
    if sfb is not None and (sfb[0] < allreduce or pb.restrictions.force_sfb):
        return _emit(kind="sfb", tensor=param, layout=R, src=P, node=consumer.name,
                     phase="backward", variant=sfb[1], predicted_s=sfb[0], alternatives=options)
    return _emit(kind="all_reduce", tensor=param, layout=R, src=P, phase="backward",
                 variant=pb.comm.gradient_variant(meta.nbytes), predicted_s=allreduce, alternatives=options)


def sfb_applicable(pb: Problem, param: str, consumer: Node, rule: Rule) -> bool:
    """A linear weight used once, replicated, with the batch (not feature) dims split."""
    if not pb.restrictions.allow_sfb or consumer.target != "aten.linear.default":
        return False
    if consumer.inputs[1:2] != (param,) or pb.graph.consumers[param] != (consumer.name,):
        return False
    x_layout = rule.inputs[0]
    ndim = len(pb.meta(consumer.inputs[0]).shape)
    d = x_layout.shard_dim
    return d is not None and d < ndim - 1 and rule.output.shard_dim is not None


def _sfb_cost(pb: Problem, param: str, consumer: Node, rule: Rule) -> tuple[float, str] | None:
    """(seconds, all-gather variant) of the cheapest SFB for `param`, if applicable."""
    if not sfb_applicable(pb, param, consumer, rule):
        return None
    shares = pb.shares(consumer.inputs[0], rule.inputs[0])
    variants = pb.restrictions.variants.get("all_gather", instruction_kind("all_gather").variants)
    return min((sfb_cost(pb, param, consumer.name, v, shares).at(shares), v) for v in variants)


def _store(pb: Problem, tensor: str, want: Layout, consumer: Node, rule: Rule) -> list[_Option]:
    node = pb.graph.node(tensor)
    options = []
    for layout in _storage_layouts(pb, node):
        first = _emit(kind=node.op, tensor=tensor, layout=layout)
        cost, extra = (pb.storage_cost(tensor, layout) if node.op == "param" else 0.0), ()
        if node.op == "param" and layout == R and node.out.requires_grad:
            sync = _grad_sync(pb, tensor, consumer, rule if want == R else None)
            cost, extra = cost + sync.predicted_s, (sync,)
        elif node.op == "param" and layout.is_two_level:
            sync = replica_sync(pb, tensor, layout)
            if sync is not None:
                cost, extra = cost + sync.predicted_s, (sync,)
        option = _Option(cost, ((tensor, layout),), (first,) + extra)
        if layout != want:
            conv = _convert(pb, tensor, {layout}, want)
            if conv is None:
                continue
            option = _Option(option.cost + conv.cost, option.facts + conv.facts,
                             option.instructions + conv.instructions)
        options.append(option)
    return options


# -- one node -------------------------------------------------------------------------------

def _input_options(pb: Problem, tensor: str, want: Layout, have: set[Layout], consumer: Node,
                   rule: Rule) -> list[_Option]:
    if want in have:
        return [_Option(0.0, (), ())]
    if not have and pb.graph.node(tensor).op != "call":
        return _store(pb, tensor, want, consumer, rule)
    conv = _convert(pb, tensor, have, want)
    return [conv] if conv is not None else []


def moves(pb: Problem, k: int, facts: frozenset[Fact], dead: frozenset[str] = frozenset()) -> list[Move]:
    """The transitions at node k from a state holding `facts` (the node's inputs' facts):
    of the moves that leave the same facts about tensors still live after node k (`dead`
    are the tensors read for the last time at k), only the cheapest."""
    node = pb.order[k]
    have: dict[str, set[Layout]] = {}
    for t, layout in facts:
        have.setdefault(t, set()).add(layout)
    best: dict[frozenset[Fact], Move] = {}
    for ri, rule in enumerate(pb.rules[node.name]):
        if _stores_twice(pb, node, rule, have):
            continue
        per_input = []
        for t, want in _distinct_wants(node, rule):
            options = _input_options(pb, t, want, have.get(t, set()), node, rule)
            if not options:
                break
            per_input.append(_cheapest_if_dead(options, t in dead))
        else:
            compute = _emit(kind="compute", tensor=node.name, node=node.name, layout=rule.output,
                            inputs=rule.inputs, local=rule.local, predicted_s=pb.compute_s(node, ri))
            for combo in product(*per_input):
                move = _combine(ri, compute, combo, node.name, rule.output)
                key = frozenset(f for f in move.added if f[0] not in dead)
                if key not in best or move.cost < best[key].cost:
                    best[key] = move
    return list(best.values())


def _cheapest_if_dead(options: list[_Option], dead: bool) -> list[_Option]:
    """A tensor read for the last time leaves no facts: only the cheapest option matters."""
    return [min(options, key=lambda o: o.cost)] if dead and len(options) > 1 else options


def _stores_twice(pb: Problem, node: Node, rule: Rule, have: dict[str, set[Layout]]) -> bool:
    """An unstored graph input wanted in two layouts by one node (we store once per input)."""
    wants: dict[str, set[Layout]] = {}
    for t, layout in zip(node.inputs, rule.inputs):
        if t not in have and pb.graph.node(t).op != "call":
            wants.setdefault(t, set()).add(layout)
    return any(len(v) > 1 for v in wants.values())


def _distinct_wants(node: Node, rule: Rule) -> list[tuple[str, Layout]]:
    seen: list[tuple[str, Layout]] = []
    for t, layout in zip(node.inputs, rule.inputs):
        if (t, layout) not in seen:
            seen.append((t, layout))
    return seen


def _combine(ri: int, compute: Emit, combo: tuple[_Option, ...], out: str, layout: Layout) -> Move:
    instructions = tuple(i for o in combo for i in o.instructions) + (compute,)
    facts = frozenset(f for o in combo for f in o.facts) | {(out, layout)}
    return Move(ri, compute.predicted_s + sum(o.cost for o in combo), facts, instructions)
