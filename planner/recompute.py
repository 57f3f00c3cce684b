"""Activation recomputation as a planning decision: its memory, and which blocks to recompute.

A recomputed unit (instruction_set.blocks; run by runtime.recompute under non-reentrant
checkpoint) keeps for the backward pass only the values it reads from before it, and runs its
forward again at the start of its backward. In the step model (planner.step_cost) each of its
instructions is charged its forward half twice (`backward_share` = 1: the whole instruction
in the backward), and its saved tensors leave the forward's memory. This module adds the rest
of its memory, per device i:

    kept_i = sum over distinct non-parameter values v read by a recomputed unit from before it
             of bytes_v * s_v,i                         (held from the forward to its backward)
    peak_i = saved_i(b*)                                (b*: the recomputed unit saving the most;
                                                         its tensors exist again during its backward)

`fit_by_recompute` is the decision: when the best program found does not fit in memory, the
first k of its units (in program order: their kept inputs live longest) are recomputed, k the
least that fits at the program's ratios (`least_units`: the memory above for k = 1..n, no
time model, milliseconds), confirmed by the full prediction after the ratio LP (with the
memory constraints) re-solves the ratios; that adds the least time among such choices for
identical blocks. The peak term is an upper bound: it counts the largest unit's tensors on top
of every other saved tensor, although the backward has freed those of the later ops by then.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from hetsynth.cost_models.memory import GIB, MemoryTerm
from hetsynth.cost_models.terms import Series, Shares, Term
from hetsynth.instruction_set.blocks import Unit, mark_recomputed, reads, recompute_units, recomputed_units, writes
from hetsynth.instruction_set.program import Instruction
from hetsynth.planner.evaluate import first_input_layouts, instruction_term, memory_bytes, share_kind
from hetsynth.planner.problem import Problem

log = logging.getLogger(__name__)


def kept_inputs(pb: Problem, program: Sequence[Instruction], unit: Unit) -> list[tuple[str, object]]:
    """The non-parameter values `unit` reads from before it (what checkpoint keeps)."""
    defined, out = set(), []
    for ins in program[unit.first:unit.last]:
        for key in reads(pb.graph, ins):
            if key not in defined and key not in out and pb.graph.node(key[0]).op not in ("param", "buffer"):
                out.append(key)
        defined.update(writes(pb.graph, ins))
    return out


def _value_term(pb: Problem, tensor: str, layout) -> Term:
    nbytes, zeros = float(pb.meta(tensor).nbytes), (0.0,) * pb.width
    memory = MemoryTerm(zeros, (nbytes,) * pb.width) if layout.is_shard else MemoryTerm((nbytes,) * pb.width, zeros)
    return Term(Series(()), memory, Shares(pb.shares(tensor, layout), share_kind([layout])))


def _saved_terms(pb: Problem, program: Sequence[Instruction], unit: Unit) -> list[Term]:
    x_layouts = first_input_layouts(program)
    out = []
    for ins in program[unit.first:unit.last]:
        term = instruction_term(pb, ins, x_layouts) if ins.kind == "compute" else None
        if term is not None and term.memory is not None:
            out.append(Term(Series(()), term.memory, term.memory_at))
    return out


def recompute_memory(pb: Problem, program: Sequence[Instruction]) -> list[Term]:
    """Memory-only terms of the recomputed units: kept inputs, and the largest unit's saved
    tensors during its backward (module docstring)."""
    units = recomputed_units(program)
    if not units:
        return []
    keys = list(dict.fromkeys(k for u in units for k in kept_inputs(pb, program, u)))
    kept = [_value_term(pb, t, l) for t, l in keys]
    peaks = [_saved_terms(pb, program, u) for u in units]
    return kept + max(peaks, key=lambda ts: max(memory_bytes(pb.width, ts)))


def _unit_bytes(pb: Problem, terms: Sequence[Term]) -> list[float]:
    return memory_bytes(pb.width, terms)


def least_units(pb: Problem, program: Sequence[Instruction], units: Sequence[Unit]) -> int | None:
    """The least k for which recomputing units[:k] fits every device at pb's ratios (memory
    only, no time: m(k) = m(0) - sum_{u<k} saved_u + kept(units[:k]) + max_{u<k} saved_u), or None."""
    x_layouts = first_input_layouts(program)
    terms = [t for i in program if not (i.kind == "all_reduce" and i.phase == "backward")
             and (t := instruction_term(pb, i, x_layouts)) is not None]
    total = _unit_bytes(pb, terms)
    caps = [k.memory_gib * GIB for k in pb.kinds]
    saved = [_unit_bytes(pb, _saved_terms(pb, program, u)) for u in units]
    keys: list = []
    peak = [0.0] * pb.width
    for k, unit in enumerate(units, start=1):
        total = [a - b for a, b in zip(total, saved[k - 1])]
        peak = [max(a, b) for a, b in zip(peak, saved[k - 1])]
        keys += [key for key in kept_inputs(pb, program, unit) if key not in keys]
        kept = _unit_bytes(pb, [_value_term(pb, t, l) for t, l in keys])
        if all(a + b + c <= cap for a, b, c, cap in zip(total, kept, peak, caps)):
            return k
    return None


def fit_by_recompute(pb: Problem, program: Sequence[Instruction],
                     fits: Callable[[tuple[Instruction, ...]], bool]) -> tuple[Instruction, ...] | None:
    """The program with its first k units recomputed, k the least that fits at pb's ratios
    (least_units), confirmed (or raised) by `fits`, the full prediction at the ratio LP's
    ratios; None when recomputing every unit does not fit, or the program has no unit."""
    units = recompute_units(pb.graph, program)
    first = least_units(pb, program, units) if units else None
    if first is None:
        log.info("recomputing %s does not fit", f"all {len(units)} blocks" if units else "(no blocks)")
        return None
    for k in range(first, len(units) + 1):
        candidate = mark_recomputed(program, units[:k])
        if fits(candidate):
            log.info("recomputing %d of %d blocks fits in memory", k, len(units))
            return candidate
    return None


__all__ = ["fit_by_recompute", "kept_inputs", "recompute_memory"]
