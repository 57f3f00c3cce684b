"""Capture by block (planner.block_capture): a model of N identical blocks traced with 2, 3
and 4 of them gives the same reference graph, node for node, as tracing all N; where the
blocks are not replicable the whole model is traced."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
from torch import nn

from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.planner import block_capture
from hetsynth.planner.capture import capture

MODELS = ["gpt:tiny,num_layers=7", "bert:tiny,num_layers=6", "vit:tiny,num_layers=6"]
if importlib.util.find_spec("transformers") is not None:
    MODELS.append("hf:llama,num_layers=6")


def _both(model: nn.Module, inputs: tuple[torch.Tensor, ...], ref: str = "m") -> tuple:
    return (capture(model, inputs, model_ref=ref), capture(model, inputs, model_ref=ref, by_block=False))


@pytest.fixture(autouse=True)
def _small_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lists of 6 blocks assembled too (the default threshold is a matter of speed only)."""
    monkeypatch.setattr(block_capture, "MIN_BLOCKS", 6)


@pytest.mark.parametrize("ref", MODELS)
@pytest.mark.slow
def test_block_capture_equals_whole(ref: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = parse_model_ref(ref)
    model = spec.build("meta")
    traced: list[int] = []
    by_blocks = block_capture.by_blocks

    def counted(trace, path, num):  # type: ignore[no-untyped-def]
        return by_blocks(lambda k: traced.append(k) or trace(k), path, num)

    monkeypatch.setattr("hetsynth.planner.capture.by_blocks", counted)
    blocks, whole = _both(model, spec.example_inputs("meta"), ref)
    assert traced == [2, 3, 4]  # assembled, not the fallback
    assert blocks.nodes == whole.nodes and blocks.loss == whole.loss
    assert blocks.model_dump() == whole.model_dump()
    assert blocks.fingerprint == whole.fingerprint and blocks.flops == whole.flops


class _Scaled(nn.Module):
    """Blocks whose forward depends on how many there are: not replicable."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) * (1.0 / len(self.blocks))
        return x.pow(2).mean()


class _Indexed(_Scaled):
    """A forward that indexes its blocks by a count of its own: cut lists fail to trace."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.n):
            x = torch.relu(self.blocks[i](x))
        return x.pow(2).mean()


@pytest.mark.parametrize("cls", [_Scaled, _Indexed])
@pytest.mark.slow
def test_unreplicable_blocks_fall_back(cls: type, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="hetsynth.planner.capture"):
        blocks, whole = _both(cls(7), (torch.randn(4, 8),))
    assert blocks.model_dump() == whole.model_dump()
    assert "the whole model is traced" in caplog.text


def test_found_lists() -> None:
    assert block_capture.repeated_list(_Scaled(block_capture.MIN_BLOCKS - 1)) is None  # too few to gain
    mixed = _Scaled(8)
    mixed.blocks[3] = nn.Linear(8, 8, bias=False)
    assert block_capture.repeated_list(mixed) is None  # not identical
    path, found = block_capture.repeated_list(_Scaled(8))
    assert path == "blocks" and len(found) == 8
