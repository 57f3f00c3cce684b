"""Model zoo and model references."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetsynth.zoo import ZOO
from hetsynth.instruction_set.models import ModelRefError, parse_model_ref, with_overrides

NATIVE = ["gpt", "bert", "vit", "vgg", "moe"]


@pytest.mark.parametrize("name", NATIVE)
def test_tiny_trains_one_step(name: str) -> None:
    spec = parse_model_ref(f"{name}:tiny")
    torch.manual_seed(0)
    model = spec.build("cpu")
    loss = model(*spec.make_batch(range(spec.batch_size), seed=1))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", NATIVE)
def test_every_model_has_tiny_and_paper(name: str) -> None:
    assert {"tiny", "paper", "small-cpu"} <= set(ZOO[name].presets)


def test_paper_presets_match_hap_setting() -> None:
    for name in ["gpt", "bert", "vit", "moe"]:
        cfg = parse_model_ref(f"{name}:paper").config
        assert (cfg.num_layers, cfg.hidden, cfg.ffn_hidden, cfg.num_heads) == (12, 768, 3072, 12)
        assert cfg.batch_size == 32 * 8
    vgg = parse_model_ref("vgg:paper").build("meta")
    assert tuple(vgg.fc1.weight.shape) == (4096, 25088)


def test_batches_are_deterministic_per_sample() -> None:
    spec = parse_model_ref("bert:tiny")
    a = spec.make_batch([3, 4, 5], seed=7)
    b = spec.make_batch([4], seed=7)
    assert torch.equal(a[0][1], b[0][0]) and torch.equal(a[1][1], b[1][0])
    assert (a[1] != -100).any(dim=1).all()  # every BERT sample has a masked target


def test_overrides_and_shared_names() -> None:
    spec = parse_model_ref("vit:paper,num_layers=64")
    assert spec.config.num_layers == 64 and spec.config.hidden == 768
    spec = parse_model_ref("gpt:tiny,hidden=96,dtype=float64")
    assert spec.config.hidden == 96 and spec.dtype == torch.float64
    assert with_overrides(spec, batch_size=3).batch_size == 3
    assert parse_model_ref("moe:tiny,num_experts=8").config.num_experts == 8


@pytest.mark.parametrize("ref,message", [
    ("gpt:huge", "presets: tiny"),
    ("gpz:tiny", "zoo models: gpt"),
    ("gpt:tiny,hiden=3", "valid options: batch_size"),
    ("gpt:tiny,hidden=x", "hidden=x: input should be a valid integer"),
    ("gpt:tiny,dtype=float77", "dtype=float77: input should be 'float16', 'bfloat16', 'float32' or 'float64'"),
    ("gpt:tiny,hidden", "key=value"),
    ("missing/file.py:make", "does not exist"),
])
def test_bad_refs(ref: str, message: str) -> None:
    with pytest.raises(ModelRefError, match=message):
        parse_model_ref(ref)


def test_user_file_factory(tmp_path: Path) -> None:
    (tmp_path / "mine.py").write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self, width):\n"
        "        super().__init__(); self.l = torch.nn.Linear(width, 1)\n"
        "    def forward(self, x): return self.l(x).pow(2).mean()\n"
        "def make(width='4'):\n"
        "    w = int(width)\n"
        "    return M(w), (torch.randn(6, w),)\n"
    )
    spec = parse_model_ref(f"{tmp_path / 'mine.py'}:make,width=3")
    assert spec.batch_size == 6
    model = spec.build("cpu")
    (x,) = spec.make_batch([0, 7], seed=0)
    assert x.shape == (2, 3) and torch.equal(x[1], spec.example_inputs("cpu")[0][1])
    assert model(x).dim() == 0
    with pytest.raises(ModelRefError, match="no callable 'nope'"):
        parse_model_ref(f"{tmp_path / 'mine.py'}:nope")


def test_hf_sizes_follow_the_overrides() -> None:
    """hf:<model_type> derives the head dim from hidden / heads (Llama's default config says
    128, T5's d_kv 64), so Llama 3 8B's shape has its 5.93e9 parameters (32,000 tokens)."""
    ref = "hf:llama,num_layers=32,hidden=4096,num_heads=32,num_kv_heads=8,ffn_hidden=11008,vocab_size=32000"
    model = parse_model_ref(ref).build("meta")
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 11008 + 2 * 4096
    assert sum(p.numel() for p in model.parameters()) == 32 * per_layer + 2 * 32000 * 4096 + 4096
    assert parse_model_ref("hf:t5,hidden=64").config.attrs["d_kv"] == 16
    assert parse_model_ref("hf:llama,head_dim=16").config.attrs["head_dim"] == 16


def test_the_zoo_reaches_the_registry_through_its_entry_point() -> None:
    """A rank resolves zoo references without importing the face: instruction_set.models
    loads the `hetsynth.models` entry points, and the zoo's registers every ZOO entry."""
    import importlib.metadata

    from hetsynth.instruction_set.models import ENTRY_POINTS, families

    assert [ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)] == ["hetsynth.zoo"]
    assert {name: f for name, f in families().items() if name in ZOO} == dict(ZOO)


@pytest.mark.slow
def test_without_model_families_the_error_says_how_to_install_them(monkeypatch: pytest.MonkeyPatch) -> None:
    import hetsynth.instruction_set.models as models

    monkeypatch.setattr(models, "_FAMILIES", {})
    monkeypatch.setattr(models, "_plugins_loaded", True)
    with pytest.raises(ModelRefError, match="unknown model 'gpt'.*no model families are installed.*pip install"):
        parse_model_ref("gpt:tiny")
