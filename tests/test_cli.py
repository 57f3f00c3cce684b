"""The command line: inspect prints summaries, user errors exit 2 with a message."""

from __future__ import annotations

import json

import pytest

from hetsynth.cli import main


def test_inspect_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--cluster", "configs/clusters/a100-t4.toml"]) == 0
    out = capsys.readouterr().out
    assert "A100" in out and "T4" in out and "8 on 2 nodes" in out


def test_inspect_model_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--model", "gpt:tiny", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["model"]
    assert data["op_counts"]["linear"] == 13 and data["num_params"] > 0
    assert data["flops_total"] == pytest.approx(data["flops_forward"] + data["flops_backward"])


def test_bad_input_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--model", "gpt:nope"]) == 2
    assert "presets: tiny" in capsys.readouterr().err
    assert main(["inspect", "--cluster", "nope.toml"]) == 2
    assert "does not exist" in capsys.readouterr().err
