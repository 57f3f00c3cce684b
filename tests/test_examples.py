"""The examples learn: each one planned for two devices of the local emulated cluster (its
`plan` command, in this process), then trained a few steps on them with `hetsynth launch`
(emulated when root, plain local processes otherwise); the run exits 0 and its last printed
loss is below its first. About 30-60 s each on 2 cores, most of it the ranks starting."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hetsynth.instruction_set.cluster import dump_cluster_toml, load_cluster
from test_launch import ROOT, hetsynth_cli

# multi-process or seconds long: make test runs them, make test-fast does not
pytestmark = pytest.mark.slow

EXAMPLES = ROOT / "examples"
FIRST_LAST = re.compile(r"first loss (\S+)\s+last loss (\S+)")


@pytest.fixture(scope="module")
def two_devices(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("examples") / "two.toml"
    path.write_text(dump_cluster_toml(load_cluster(ROOT / "configs" / "clusters" / "local-emulated.toml").first(2)))
    return path


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def planned(name: str, cluster: Path, out: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> Path:
    """`python examples/NAME.py plan -o OUT --cluster CLUSTER ARGS`, run from the repository root."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [f"examples/{name}.py", "plan", "-o", str(out), "--cluster", str(cluster), *args])
    example(name).main()
    return out


def launched(plan: Path, name: str, *args: str) -> str:
    """`hetsynth launch PLAN examples/NAME.py train ARGS`: its output, after checking that it
    exited 0 and that the loss fell."""
    run = hetsynth_cli("launch", str(plan), f"examples/{name}.py", "train", *args, timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    found = FIRST_LAST.search(output)
    assert found, output
    first, last = float(found[1]), float(found[2])
    assert last < first, output
    return output


def test_char_gpt_learns(two_devices: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = planned("char_gpt", two_devices, tmp_path / "plan.json", monkeypatch, "--size", "tiny")
    losses = tmp_path / "losses.json"
    output = launched(plan, "char_gpt", "--steps", "15", "--log-every", "5", "--losses", str(losses))
    assert "held-out loss" in output
    curve = json.loads(losses.read_text())
    assert len(curve["losses"]) == 15 and curve["ms_per_step"] > 0


def test_hf_causal_lm_learns_and_saves(two_devices: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    plan = planned("hf_causal_lm", two_devices, tmp_path / "plan.json", monkeypatch, "--arch", "gpt2")
    saved = tmp_path / "gpt2"
    launched(plan, "hf_causal_lm", "--steps", "15", "--log-every", "5", "--save-pretrained", str(saved))
    model = transformers.AutoModelForCausalLM.from_pretrained(saved)
    ids = torch.tensor([list(b"def main():\n    return 0\n")])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert model.config.model_type == "gpt2"
    assert torch.isfinite(loss) and float(loss) < 5.0, float(loss)  # untrained: about ln 256 = 5.5


def test_digits_cnn_learns(two_devices: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("sklearn")
    plan = planned("digits_cnn", two_devices, tmp_path / "plan.json", monkeypatch)
    output = launched(plan, "digits_cnn", "--steps", "40", "--log-every", "10")
    accuracy = float(re.search(r"test accuracy (\S+)", output)[1])
    assert accuracy > 0.5, output
