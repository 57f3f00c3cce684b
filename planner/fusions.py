"""Fused collective-matmuls in a program (CommFuse): where the plain pair appears, the cost
model chooses per instruction among the pair, the ring and k-slicing (k = 2, 4).

The pairs (instruction_set.program.FUSED_MATMULS):

  all_gather t S(d) -> R (along an axis)  ...  compute linear(t:R, W, b)         -> ag_matmul
      the linear's first input gathered along a dim d other than its last, its local
      rewrite plain, and nothing between the two instructions reading t in R (the fused
      instruction makes t:R available at the linear: later readers use the gathered x free)
  compute linear(...) -> y:P  ...  reduce_scatter y P -> S(d) (along an axis)    -> matmul_rs
      d not the last dim, the scatter leaving nothing Partial, nothing else reading y:P, the
      local rewrite plain or the bias once (the fused form adds the bias after the sum)

Neither inside a recomputed block. A pair's options are priced forward plus backward (the
fused adjoint): the pair as the plan prices it (the collective with its adjoint, the linear's
compute term) and each fused variant (cost_models.fused, at the plan's ratios, with the device
kinds' measured transfer CPU share and per-message cost); the cheapest wins (`force`: the
cheapest fused variant, for tests and the benchmark's forced case). This is a pass over the
searched program, not a move of the search: the search's layouts and the LP's ratios are
chosen with the plain pairs' costs, and the fused forms are constants at those ratios.
`unfuse_program` turns every fused instruction back into its pair (the control of
bench/overlap.py, planner.without_fusion).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hetsynth.cost_models.fused import Ring, form, ring_cost, sliced_cost
from hetsynth.cost_models.memory import activation_memory
from hetsynth.cost_models.terms import Cost, Series, Shares, Term, seconds
from hetsynth.instruction_set.kinds import Category, fused_slices, kind as instruction_kind
from hetsynth.instruction_set.layouts import Layout
from hetsynth.instruction_set.mesh import MeshAxis
from hetsynth.instruction_set.program import FUSED_MATMULS, Instruction
from hetsynth.planner.evaluate import TERMS, _rule_index, instruction_term, share_kind
from hetsynth.planner.problem import Problem

FUSABLE = ("aten.linear.default",)


@dataclass(frozen=True)
class Pair:
    kind: str          # the fused kind
    collective: int    # index of the all_gather / reduce_scatter in the program
    compute: int       # index of the linear's compute


def _readers(program: Sequence[Instruction], pb: Problem, tensor: str, layout: Layout,
             skip: set[int]) -> list[int]:
    """Indices of the instructions that read tensor:layout (a conversion's source, an op's input)."""
    out = []
    for i, ins in enumerate(program):
        if i in skip:
            continue
        if ins.src is not None and ins.src_tensor(pb.graph.node(ins.node).inputs if ins.node else ()) == tensor \
                and ins.src == layout:
            out.append(i)
        elif ins.runs_op and any(t == tensor and l == layout
                                 for t, l in zip(pb.graph.node(ins.node).inputs, ins.inputs)):
            out.append(i)
    return out


def _linear(pb: Problem, ins: Instruction) -> bool:
    return ins.kind == "compute" and not ins.recompute and pb.graph.node(ins.node).target in FUSABLE


def _gather_pairs(pb: Problem, program: Sequence[Instruction]) -> list[Pair]:
    made = {(ins.tensor, ins.layout): i for i, ins in enumerate(program)
            if ins.kind == "all_gather" and ins.phase == "forward" and not ins.recompute}
    out = []
    for q, ins in enumerate(program):
        if not _linear(pb, ins) or ins.local:
            continue
        x = pb.graph.node(ins.node).inputs[0]
        p = made.get((x, ins.inputs[0]))
        if p is None or p > q:
            continue
        d = program[p].src.axis(program[p].axis).dim
        if d == len(pb.meta(x).shape) - 1:
            continue
        if not [r for r in _readers(program, pb, x, ins.inputs[0], {q}) if p < r < q]:
            out.append(Pair("ag_matmul", p, q))
    return out


def _scatter_pairs(pb: Problem, program: Sequence[Instruction]) -> list[Pair]:
    out = []
    for q, ins in enumerate(program):
        if not _linear(pb, ins) or not ins.layout.outer.is_partial and not ins.layout.inner.is_partial:
            continue
        readers = _readers(program, pb, ins.tensor, ins.layout, {q})
        if len(readers) != 1:
            continue
        rs = program[readers[0]]
        if rs.kind != "reduce_scatter" or rs.recompute or rs.layout.outer.is_partial or rs.layout.inner.is_partial:
            continue
        if rs.layout.axis(rs.axis).dim == len(pb.meta(ins.tensor).shape) - 1:
            continue
        if ins.local and not ins.local.startswith("once:2"):
            continue
        out.append(Pair("matmul_rs", readers[0], q))
    return out


def fused_instruction(program: Sequence[Instruction], pair: Pair, variant: str) -> Instruction:
    coll, lin = program[pair.collective], program[pair.compute]
    if pair.kind == "ag_matmul":
        return lin.model_copy(update={"kind": "ag_matmul", "src": coll.src, "axis": coll.axis, "variant": variant})
    return lin.model_copy(update={"kind": "matmul_rs", "src": lin.layout, "layout": coll.layout, "axis": coll.axis,
                                  "variant": variant})


def pair_instructions(pb: Problem, ins: Instruction) -> list[Instruction]:
    """A fused instruction as its plain pair (the collective in its cheapest variant)."""
    node = pb.graph.node(ins.node)
    if ins.kind == "ag_matmul":
        x = node.inputs[0]
        step = pb.collective(x, "all_gather", ins.src, ins.inputs[0], ins.axis)
        return [Instruction(kind="all_gather", tensor=x, layout=ins.inputs[0], src=ins.src, variant=step.variant,
                            axis=ins.axis),
                ins.model_copy(update={"kind": "compute", "src": None, "variant": "", "axis": MeshAxis.ALL,
                                       "alternatives": {}})]
    step = pb.collective(ins.tensor, "reduce_scatter", ins.src, ins.layout, ins.axis)
    plain = {"kind": "compute", "src": None, "variant": "", "axis": MeshAxis.ALL, "alternatives": {}}
    return [ins.model_copy(update=plain | {"layout": ins.src}),
            Instruction(kind="reduce_scatter", tensor=ins.tensor, layout=ins.layout, src=ins.src,
                        variant=step.variant, axis=ins.axis)]


def _ring(pb: Problem, ins: Instruction, tensor: str, split: Layout, whole: Layout, matmul_s: Sequence[float]) -> Ring:
    """The ring of one fused instruction: `tensor` split by `split` along the axis (the chunks),
    held whole by every member in `whole` (its rows' bytes). The transfer CPU (gamma, m) is the
    point-to-point one (DeviceKind.p2p_cpu) for the ring, whose steps are isend/irecv, and the
    collectives' for k-slicing, whose slices are padded collectives."""
    dim = split.axis(ins.axis).dim
    lengths = pb.lengths.rank_lengths(tensor, split)[dim]
    groups = [tuple(pb.mesh.members(ins.axis, r)) for r in pb.devices.reps]
    group_lengths = tuple(tuple(lengths[m] for m in g) for g in groups)
    held = pb.shares(tensor, whole)
    nbytes = float(pb.meta(tensor).nbytes)
    alpha, beta = pb.comm.alpha_beta("all_gather", "ring", ins.axis)
    cpus = [k.p2p_cpu() if ins.variant == "ring" else (k.transfer_cpu_share, k.transfer_cpu_us_per_message)
            for k in pb.kinds]
    return Ring(member=tuple(g.index(r) for g, r in zip(groups, pb.devices.reps)), matmul_s=tuple(matmul_s),
                gamma=tuple(cpu[0] for cpu in cpus), per_message_s=tuple(cpu[1] * 1e-6 for cpu in cpus),
                membw=tuple(k.memory_bandwidth_gbyte_s * 1e9 for k in pb.kinds), lengths=group_lengths,
                row_bytes=tuple(nbytes * h / max(sum(gl), 1) for h, gl in zip(held, group_lengths)),
                alpha=alpha, beta=beta)


def _halves(pb: Problem, ins: Instruction, rule_out: Layout) -> tuple[list[float], list[float]]:
    """(forward, backward) seconds of the linear's local work per entry."""
    node = pb.graph.node(ins.node)
    ri = _rule_index(pb, ins.model_copy(update={"kind": "compute", "layout": rule_out}))
    whole = pb.compute_linear(node, ri).per_device(pb.rule_shares(node, pb.rules[node.name][ri]))
    total = node.flops_fwd + node.flops_bwd
    phi = node.flops_fwd / total if total > 0 else 1.0 / 3.0
    return [w * phi for w in whole], [w * (1 - phi) for w in whole]


def fused_cost(pb: Problem, ins: Instruction) -> tuple[Cost, Cost]:
    """(forward, backward) time of a fused instruction (cost_models.fused)."""
    node = pb.graph.node(ins.node)
    gather = ins.kind == "ag_matmul"
    rule_out = ins.layout if gather else ins.src
    fwd, bwd = _halves(pb, ins, rule_out)
    tensor, split, whole = (node.inputs[0], ins.src, ins.inputs[0]) if gather else (ins.tensor, ins.layout, ins.src)
    k = fused_slices(ins.variant)
    if gather:  # backward: dgrad reduce-scattered (half the backward work), then wgrad
        rings = (_ring(pb, ins, tensor, split, whole, fwd), _ring(pb, ins, tensor, split, whole, [b / 2 for b in bwd]))
    else:       # backward: dy gathered under dgrad and wgrad
        rings = (_ring(pb, ins, tensor, split, whole, fwd), _ring(pb, ins, tensor, split, whole, bwd))
    if k == 0:
        f, b = ring_cost(rings[0], gather), ring_cost(rings[1], not gather)
    else:
        shares, nbytes = pb.axis_shares(tensor, split, whole, ins.axis)
        one = lambda kind: pb.comm.cost(kind, "padded", nbytes / k, ins.axis, shares).at(shares)
        f = sliced_cost(rings[0], gather, k, one("all_gather" if gather else "reduce_scatter"))
        b = sliced_cost(rings[1], not gather, k, one("reduce_scatter" if gather else "all_gather"))
    if gather:
        b = Series((b, form([x / 2 for x in bwd], Category.COMPUTE)))
    return f, b


@TERMS.implements(*FUSED_MATMULS)
def _fused_term(pb: Problem, ins: Instruction, x_layouts: dict[str, Layout]) -> Term:
    """Series(forward, backward): planner.step_cost places the halves."""
    node = pb.graph.node(ins.node)
    rule_out = ins.layout if ins.kind == "ag_matmul" else ins.src
    shares = Shares(pb.shares(ins.tensor, rule_out) if rule_out.is_shard else (1.0,) * pb.width,
                    share_kind((rule_out, *ins.inputs)))
    return Term(Series(fused_cost(pb, ins)),
                activation_memory(node, ins.inputs, rule_out, pb.width, shares.values, pb.shares), shares)


def options(pb: Problem, program: Sequence[Instruction], pair: Pair) -> dict[str, float]:
    """Seconds (forward + backward) of the plain pair and of every allowed fused variant."""
    x_layouts: dict[str, Layout] = {}
    plain = sum(seconds(t.time) for t in (instruction_term(pb, program[i], x_layouts)
                                          for i in (pair.collective, pair.compute)) if t is not None)
    out = {"unfused": plain}
    for variant in pb.restrictions.variants.get(pair.kind, instruction_kind(pair.kind).variants):
        fused = fused_instruction(program, pair, variant)
        out[variant] = seconds(Series(fused_cost(pb, fused)))
    return out


def fuse_program(pb: Problem, program: Sequence[Instruction], *, force: bool = False) -> list[Instruction]:
    """The program with every pair the cost model prefers fused (all of them when `force`)."""
    pairs = _gather_pairs(pb, program) + _scatter_pairs(pb, program)
    used: set[int] = set()
    replace: dict[int, Instruction] = {}
    drop: set[int] = set()
    for pair in sorted(pairs, key=lambda p: p.compute):
        if pair.compute in used or pair.collective in used:
            continue
        costs = options(pb, program, pair)
        pick = min((v for v in costs if v != "unfused" or not force), key=lambda v: costs[v])
        if pick == "unfused":
            continue
        used |= {pair.compute, pair.collective}
        replace[pair.compute] = fused_instruction(program, pair, pick).model_copy(
            update={"alternatives": costs, "predicted_s": costs[pick]})
        drop.add(pair.collective)
    return [replace.get(i, ins) for i, ins in enumerate(program) if i not in drop]


def unfuse_program(pb: Problem, program: Sequence[Instruction]) -> list[Instruction]:
    out: list[Instruction] = []
    for ins in program:
        out += pair_instructions(pb, ins) if ins.kind in FUSED_MATMULS else [ins]
    return out


__all__ = ["FUSABLE", "Pair", "fuse_program", "fused_cost", "options", "unfuse_program"]
