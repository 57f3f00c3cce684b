"""The registry of instruction kinds (instruction_set.kinds): every kind has its cost term,
emitter and (for layout changes) its conversion and cost formula; a kind without one fails
loudly, naming it and what is registered, while planning, running and loading a plan."""

from __future__ import annotations

from pathlib import Path

import pytest

import hetsynth
from hetsynth.cost_models.comm import FORMULAS
from hetsynth.instruction_set import kinds as K
from hetsynth.instruction_set.kinds import Category, InstructionKind, MissingImplementation, Phase, conversion_kind
from hetsynth.instruction_set.layouts import PlacementKind
from hetsynth.instruction_set.plan import PlanError, plan_from_json
from hetsynth.instruction_set.program import Instruction
from hetsynth.planner.evaluate import TERMS, instruction_term
from hetsynth.planner.problem import Problem
from hetsynth.runtime.codegen import EMITTERS, build_rank_program
from hetsynth.runtime.conversions import CONVERSIONS
from hetsynth.runtime.groups import Groups

CLUSTER = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "a100-t4.toml"


def _keys(k: InstructionKind) -> list[tuple[str, Phase]]:
    return [(k.name, p) for p in sorted(k.phases)]


def test_every_kind_has_its_cost_term_and_emitter() -> None:
    keys = [(name, phase, None) for k in K.kinds() for name, phase in _keys(k)]
    assert TERMS.missing(keys) == []
    assert EMITTERS.missing(keys) == []


def test_every_layout_change_has_a_conversion_and_every_collective_variant_a_formula() -> None:
    for k in K.kinds(Category.COMMUNICATION) + K.kinds(Category.LOCAL):
        assert CONVERSIONS.missing([(k.name, Phase.FORWARD, None)]) == [], k.name
    for k in K.kinds(Category.COMMUNICATION):
        assert FORMULAS.missing([(k.name, Phase.FORWARD, v) for v in k.variants]) == [], k.name


def test_the_runtime_implements_every_gather_and_scatter_variant_and_the_profiler_times_kinds() -> None:
    from hetsynth.profiling.profiler import CASES
    from hetsynth.runtime.collectives import COLLECTIVE_VARIANTS

    for name in ("all_gather", "reduce_scatter"):
        assert COLLECTIVE_VARIANTS.missing([(name, Phase.FORWARD, v) for v in K.kind(name).variants]) == []
    for case in CASES:
        name, variant = case.split(".")
        assert variant in K.kind(name).variants, case


def test_storage_kinds_are_the_graph_input_ops() -> None:
    from hetsynth.instruction_set.graph import Node

    ops = set(Node.model_fields["op"].annotation.__args__) - {"call"}
    assert {k.name for k in K.kinds(Category.STORAGE)} == ops


def test_conversion_table() -> None:
    """The forward layout changes along one axis, for every pair of placement kinds."""
    expected = {("S", "R"): "all_gather", ("P", "S"): "reduce_scatter", ("P", "R"): "all_reduce",
                ("Pmax", "R"): "all_reduce_max", ("S", "S"): "all_to_all", ("R", "S"): "slice",
                ("R", "P"): "partial"}
    for a in PlacementKind:
        for b in PlacementKind:
            found = conversion_kind(a, b)
            assert (found.name if found else None) == expected.get((a, b)), (a, b)


def test_adjoint_variant_falls_back_to_the_adjoints_first() -> None:
    back, variant = K.kind("all_gather").adjoint_variant("ring")
    assert (back.name, variant) == ("reduce_scatter", "ring")
    assert K.kind("all_reduce_max").adjoint_variant("ring") is None


@pytest.fixture(scope="module")
def plan() -> hetsynth.Plan:
    return hetsynth.plan("gpt:tiny", cluster=str(CLUSTER))


@pytest.fixture
def scratch(monkeypatch: pytest.MonkeyPatch) -> Instruction:
    """A registered kind that no layer implements, and one instruction of it."""
    monkeypatch.setitem(K._KINDS, "scratch", InstructionKind("scratch", Category.COMMUNICATION, variants=("x",)))
    return Instruction(kind="scratch", tensor="t", layout="R", src="P", variant="x")


@pytest.mark.slow
def test_planning_a_kind_without_a_cost_term_fails_loudly(plan: hetsynth.Plan, scratch: Instruction) -> None:
    pb = Problem(plan.graph, plan.cluster, plan.sharding_ratios)
    with pytest.raises(MissingImplementation, match="'scratch'.*all_gather"):
        instruction_term(pb, scratch, {})


@pytest.mark.slow
def test_running_a_kind_without_codegen_fails_before_emitting(plan: hetsynth.Plan, scratch: Instruction) -> None:
    bad = plan.model_copy(update={"instructions": (*plan.instructions, scratch)})
    with pytest.raises(MissingImplementation, match="codegen for instruction kind 'scratch'.*all_gather"):
        build_rank_program(bad, Groups.local_only(bad.mesh, 0))


def test_a_plan_with_an_unknown_kind_does_not_load(plan: hetsynth.Plan) -> None:
    raw = plan.model_dump(mode="json")
    raw["instructions"][3]["kind"] = "mm_all_to_all"
    with pytest.raises(PlanError, match="instructions.3.kind.*unknown instruction kind 'mm_all_to_all'.*all_gather"):
        plan_from_json(raw, "plan.json")


def test_fused_variants_name_their_slices_and_unknown_ones_fail() -> None:
    from hetsynth.instruction_set.kinds import FUSED_VARIANTS, fused_slices

    assert [fused_slices(v) for v in FUSED_VARIANTS] == [0, 2, 4]
    with pytest.raises(ValueError, match="sliced3.*valid: ring, sliced2, sliced4"):
        fused_slices("sliced3")
