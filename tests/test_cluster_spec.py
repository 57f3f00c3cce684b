"""Cluster specs: the shipped configs load, and malformed specs fail naming the problem."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from hetsynth.instruction_set.cluster import ClusterSpecError, cluster_from_dict, dump_cluster_toml, load_cluster

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "clusters"

BASE = {
    "name": "t",
    "device_kinds": {"A": {"throughput_flops": 1e12, "memory_gib": 16}},
    "devices": [{"name": "g0", "kind": "A"}, {"name": "g1", "kind": "A"}],
    "nodes": [{"name": "n0", "devices": ["g0"]}, {"name": "n1", "devices": ["g1"]}],
    "links": {"intra_node_bandwidth_gbps": 100, "inter_node_bandwidth_gbps": 10},
}


def spec_with(edit) -> dict:
    raw = copy.deepcopy(BASE)
    edit(raw)
    return raw


@pytest.mark.parametrize("name,devices", [("hap-paper", 64), ("a100-t4", 8), ("a100x8", 8),
                                          ("local-emulated", 4)])
def test_shipped_specs_load(name: str, devices: int) -> None:
    spec = load_cluster(CONFIGS / f"{name}.toml")
    assert spec.num_devices == devices
    assert len({spec.node_of(r) for r in range(devices)}) == len(spec.nodes)


def test_hap_paper_is_16_v100_and_48_p100() -> None:
    spec = load_cluster(CONFIGS / "hap-paper.toml")
    kinds = [d.kind for d in spec.devices]
    assert kinds.count("V100") == 16 and kinds.count("P100") == 48
    assert spec.links.inter_node_bandwidth_gbps == pytest.approx(10.4)


def _bad(edit) -> str:
    with pytest.raises(ClusterSpecError) as info:
        cluster_from_dict(spec_with(edit), source="bad.toml")
    return str(info.value)


def test_missing_field_is_named() -> None:
    msg = _bad(lambda r: r["links"].pop("inter_node_bandwidth_gbps"))
    assert "links.inter_node_bandwidth_gbps" in msg and "missing" in msg


def test_negative_bandwidth_names_value() -> None:
    msg = _bad(lambda r: r["links"].__setitem__("intra_node_bandwidth_gbps", -5))
    assert "links.intra_node_bandwidth_gbps = -5" in msg and "greater than 0" in msg


def test_device_on_two_nodes() -> None:
    msg = _bad(lambda r: r["nodes"][1].__setitem__("devices", ["g1", "g0"]))
    assert "'g0' is listed on two nodes" in msg and "'n0'" in msg and "'n1'" in msg


def test_node_without_devices() -> None:
    def edit(r):
        r["nodes"].append({"name": "empty", "devices": []})

    msg = _bad(edit)
    assert "node 'empty' has no devices" in msg


def test_unknown_kind_lists_valid_kinds() -> None:
    msg = _bad(lambda r: r["devices"][0].__setitem__("kind", "H100"))
    assert "'H100'" in msg and "['A']" in msg


def test_unknown_field_is_rejected() -> None:
    msg = _bad(lambda r: r["links"].__setitem__("inter_node_bandwith_gbps", 3))
    assert "inter_node_bandwith_gbps" in msg


def test_shorthand_num_devices_must_be_positive() -> None:
    raw = spec_with(lambda r: None)
    raw.pop("devices")
    raw["nodes"] = [{"name": "n0", "kind": "A", "num_devices": 0}]
    with pytest.raises(ClusterSpecError, match="num_devices = 0"):
        cluster_from_dict(raw)


def test_json_and_toml_round_trip(tmp_path: Path) -> None:
    spec = load_cluster(CONFIGS / "a100-t4.toml")
    (tmp_path / "c.json").write_text(json.dumps(spec.model_dump(mode="json")))
    (tmp_path / "c.toml").write_text(dump_cluster_toml(spec))
    assert load_cluster(tmp_path / "c.json") == spec
    assert load_cluster(tmp_path / "c.toml") == spec


def test_first_n_devices() -> None:
    spec = load_cluster(CONFIGS / "hap-paper.toml").first(12)
    assert spec.num_devices == 12 and [len(n.devices) for n in spec.nodes] == [8, 4]
    with pytest.raises(ClusterSpecError, match="1..64"):
        load_cluster(CONFIGS / "hap-paper.toml").first(65)


def test_missing_file() -> None:
    with pytest.raises(ClusterSpecError, match="does not exist"):
        load_cluster("no/such/file.toml")
