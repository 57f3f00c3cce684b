"""Typed layouts (instruction_set.layouts): one parser of the text form, interned values that
survive pickle and copies, string order, layouts bound to a (sub-)mesh, and the plan's JSON
(version 7, version-1 to -6 files still read)."""

from __future__ import annotations

import copy
import json
import logging
import pickle
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from hetsynth import capture_model
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.instruction_set.layouts import (P, PMAX, R, Layout, Partial, PartialMax, Placement, PlacementKind, Replicate, S,
                                     Shard)
from hetsynth.instruction_set.mesh import Mesh, MeshAxis
from hetsynth.instruction_set.plan import PLAN_VERSION, Plan, PlanError, load_plan, plan_from_json, save_plan
from hetsynth.instruction_set.program import Instruction
from hetsynth.instruction_set.shards import MeshLayout
from hetsynth.planner.planner import make_plan
from hetsynth.planner.problem import Problem, Restrictions, StorageClass, rule_entries
from hetsynth.planner.transitions import _storage_layouts

CLUSTER = Path(__file__).resolve().parent.parent / "configs" / "clusters" / "local-emulated.toml"
TEXT = re.compile(r"(R|P|Pmax|S(0|[1-9][0-9]*))(\|(R|P|S(0|[1-9][0-9]*)))?")


def _space(ref: str) -> set[Layout]:
    """Every layout of a model's program space on a two-level mesh: all rules' entries
    (one-level and products) and every graph input's storage layouts."""
    graph = capture_model(ref)
    cluster = load_cluster(CLUSTER)
    pb = Problem(graph, cluster, [1 / cluster.num_devices] * cluster.num_devices)
    assert pb.mesh.two_level
    out = {l for n in pb.order for rule in pb.rules[n.name] for _, l in rule_entries(n, rule)}
    return out | {l for n in graph.nodes if n.op != "call" for l in _storage_layouts(pb, n)}


@pytest.mark.parametrize("ref", ["gpt:tiny", "moe:tiny", "vgg:tiny"])
@pytest.mark.slow
def test_every_layout_of_the_space_reads_back_as_itself(ref: str) -> None:
    space = _space(ref)
    assert any(l.is_two_level for l in space) and PMAX in space or ref != "gpt:tiny"
    for layout in space:
        text = str(layout)
        assert TEXT.fullmatch(text) and Layout.parse(text) is layout, text
        assert layout.is_two_level == ("|" in text) and layout.is_shard == ("S" in text)


@pytest.mark.parametrize("text, why", [
    ("X", "'X' is no placement"), ("S", "'S' is no placement"), ("S01", "'S01' is no placement"),
    ("s0", "'s0' is no placement"), ("S-1", "'S-1' is no placement"), ("", "'' is no placement"),
    ("R|R|R", "more than two axes"), ("Pmax|R", "Pmax exists one-level only"), ("S0|", "'' is no placement")])
def test_a_bad_layout_is_refused_naming_it_and_the_grammar(text: str, why: str) -> None:
    with pytest.raises(ValueError) as err:
        Layout.parse(text)
    message = str(err.value)
    assert text in message and why in message and "R, P, Pmax, S<d>" in message, message


def test_a_bad_layout_in_an_instruction_is_a_validation_error() -> None:
    with pytest.raises(ValidationError, match=r"layout 'S0\|Q' is not a layout"):
        Instruction(kind="compute", tensor="t", layout="S0|Q")
    with pytest.raises(ValueError, match="not valid for a 2-d tensor; use R, P, Pmax, S0..S1"):
        S(2).check(2)


def test_values_are_interned_and_immutable() -> None:
    assert Layout(Shard(0)) is S(0) is Layout(Shard(0), Shard(0)) is Layout.parse("S0|S0")
    assert Layout(Replicate()) is R and Layout(Partial()) is P and Layout(PartialMax()) is PMAX
    assert Placement("S", 3) is Shard(3) and Shard(3).kind is PlacementKind.SHARD
    two = Layout.parse("S0|R")
    assert (two.outer, two.inner, two.dims, two.shard_dim) == (Shard(0), Replicate(), (0,), None)
    assert S(1).shard_dim == 1 and Layout.parse("S0|S2").dims == (0, 2)
    assert {S(0): "x"}[Layout.parse("S0")] == "x"
    with pytest.raises(AttributeError):
        two.text = "R"  # type: ignore[misc]


def test_identity_survives_pickle_and_copies() -> None:
    values = [R, P, PMAX, S(0), S(7), Layout.parse("S0|R"), Layout.parse("R|S2"), Shard(1), Replicate()]
    assert all(pickle.loads(pickle.dumps(v)) is v for v in values)
    assert all(copy.copy(v) is v and copy.deepcopy(v) is v for v in values)
    ins = Instruction(kind="all_gather", tensor="t", layout=R, src=Layout.parse("S0|R"), inputs=(S(1),))
    for again in (pickle.loads(pickle.dumps(ins)), ins.model_copy(deep=True), copy.deepcopy(ins)):
        assert again.layout is R and again.src is ins.src and again.inputs[0] is S(1)


def test_sorted_order_is_the_order_of_the_text() -> None:
    values = [S(10), R, Layout.parse("S0|R"), P, S(2), PMAX, Layout.parse("R|S1"), S(0), Layout.parse("P|S0")]
    assert [str(v) for v in sorted(values)] == sorted(str(v) for v in values)
    assert f"{S(3)}|{Layout.parse('R|S1'):>5}" == "S3| R|S1"


def test_restrictions_read_layout_text() -> None:
    r = Restrictions(force={"x": "S0|R"}, input_layout="S0", param_layouts=["replicated"])
    assert r.force["x"] is Layout.parse("S0|R") and r.input_layout is S(0)
    assert r.param_layouts == {StorageClass.REPLICATED}
    assert [StorageClass.of(l) for l in (R, S(1), Layout.parse("R|S0"))] == list(StorageClass)


def test_a_layout_on_a_sub_mesh_places_its_ranks() -> None:
    stage = Mesh.of([2, 2, 2]).sub(1, 2)  # nodes 1 and 2: ranks 2..5, 2 x 2
    across = MeshLayout(stage, Layout.parse("S0|R"))  # lengths per member: node blocks of 3 and 5
    assert [across.offset([3, 3, 5, 5], 0, r) for r in stage.ranks] == [0, 0, 3, 3]
    flat = MeshLayout(stage, S(0))
    assert [flat.offset([1, 2, 3, 4], 0, r) for r in stage.ranks] == [0, 1, 3, 6]
    inside = MeshLayout(stage, Layout.parse("R|S1"))
    assert [inside.offset([2, 6, 2, 6], 1, r) for r in stage.ranks] == [0, 2, 0, 2]
    assert [inside.counts_once(r) for r in stage.ranks] == [True, True, False, False]
    assert [MeshLayout(stage, R).counts_once(r) for r in stage.ranks] == [True, False, False, False]
    assert list(inside.group(MeshAxis.OUTER, 5)) == [3, 5] and str(across) == "S0|R on ranks 2..5"


@pytest.fixture(scope="module")
def plan() -> Plan:
    graph = capture_model("gpt:tiny")
    cluster = load_cluster(CLUSTER)
    return make_plan(graph, cluster, ratios=[0.4, 0.3, 0.2, 0.1], progress=False, with_baselines=False,
                     restrictions=Restrictions(input_layout="S0|R"))  # a two-level layout in the plan


@pytest.mark.slow
def test_plan_json_round_trip_keeps_layouts_as_text(plan: Plan, tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    raw = json.loads(path.read_text())
    assert raw["version"] == PLAN_VERSION == 7
    assert raw["mesh"] == {"num_nodes": 2, "per_node": 2, "two_level": True, "first_rank": 0}
    texts = {i["layout"] for i in raw["instructions"]} | {l for t in raw["shards"].values() for l in t}
    assert all(isinstance(t, str) and TEXT.fullmatch(t) for t in texts) and any("|" in t for t in texts)
    assert all(i["src"] is None or TEXT.fullmatch(i["src"]) for i in raw["instructions"])
    again = load_plan(path)
    assert again == plan
    assert all(a.layout is b.layout and a.src is b.src for a, b in zip(again.instructions, plan.instructions))
    assert plan.placed(S(0)) == MeshLayout(plan.mesh, S(0))


def _as_version_1(raw: dict) -> dict:
    mesh = raw["mesh"]
    return {**raw, "version": 1, "mesh": [mesh["num_nodes"], mesh["per_node"]],
            "instructions": [{**i, "src": i["src"] or ""} for i in raw["instructions"]]}


@pytest.mark.slow
def test_a_version_1_plan_is_read_with_a_warning(plan: Plan, caplog: pytest.LogCaptureFixture) -> None:
    old = _as_version_1(json.loads(plan.model_dump_json()))
    with caplog.at_level(logging.WARNING, logger="hetsynth.instruction_set.plan"):
        assert plan_from_json(old, "old.json") == plan
    assert f"old.json is plan format version 1; read as version {PLAN_VERSION}" in caplog.text


def test_another_version_is_refused_saying_what_changed(plan: Plan) -> None:
    raw = {**json.loads(plan.model_dump_json()), "version": 8}
    with pytest.raises(PlanError, match=r"new.json is plan format version 8; this hetsynth reads versions 1 to 7 "
                                        r"\(version 7: the precision policy.*Re-run `hetsynth plan`"):
        plan_from_json(raw, "new.json")
