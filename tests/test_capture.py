"""Capture into the reference graph: shapes, FLOPs, unsupported ops, fallback, HF models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetsynth import capture_model
from hetsynth.models import parse_model_ref
from instruction_set.interpret import graph_inputs, run_graph
from instruction_set.rules import is_supported
from planner.capture import CaptureError, UnsupportedOpsError, capture, summarize

ZOO_TINY = ["gpt:tiny", "bert:tiny", "vit:tiny", "vgg:tiny", "moe:tiny"]


@pytest.mark.parametrize("ref", ZOO_TINY + ["hf-gpt2:tiny", "hf-bert:tiny"])
def test_reference_graph_computes_the_models_loss(ref: str) -> None:
    """The captured graph (cross-entropy decomposed) gives the module's own loss."""
    spec = parse_model_ref(ref + ",dtype=float64" if not ref.startswith("hf") else ref)
    graph = capture_model(spec.ref)
    torch.manual_seed(0)
    model = spec.build("cpu")
    batch = spec.make_batch(range(spec.batch_size), seed=3)
    expected = model(*batch)
    got = run_graph(graph, graph_inputs(graph, model, batch))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert all(is_supported(n.target) for n in graph.calls)
    assert "cross_entropy_loss" not in summarize(graph)["op_counts"]


def test_gpt2_small_flops_match_6nd() -> None:
    for ref in ["gpt:tiny", "gpt:small"]:
        spec = parse_model_ref(ref)
        graph = capture_model(ref)
        tokens = spec.batch_size * spec.config.seq_len
        estimate = 6 * graph.num_params * tokens
        assert abs(sum(graph.flops) / estimate - 1) < 0.25, (ref, sum(graph.flops), estimate)
        fwd, bwd = graph.flops
        assert 1.8 < bwd / fwd < 2.2


def test_gpt2_xl_captures_on_meta() -> None:
    graph = capture_model("gpt:xl")
    assert 1.5e9 < graph.num_params < 1.6e9
    assert sum(1 for n in graph.calls if n.target == "aten.scaled_dot_product_attention.default") == 48


def test_nodes_carry_module_path_source_and_grad_flags() -> None:
    graph = capture_model("gpt:tiny")
    linears = [n for n in graph.calls if n.target == "aten.linear.default"]
    assert linears[0].module_path == "blocks.0.attn.query"
    assert "layers.py" in linears[0].source
    assert linears[0].out.requires_grad and linears[0].flops_fwd > 0 and linears[0].flops_bwd > 0
    ne = next(n for n in graph.calls if n.target == "aten.ne.Scalar")
    assert not ne.out.requires_grad and ne.out.dtype == "bool"


class Spectral(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft(x, dim=-1).abs()


class WithFFT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.mixer = Spectral()
        self.mixer2 = Spectral()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.mixer2(self.mixer(self.proj(x))).sum(-1) ** 2).mean()


def test_unsupported_ops_are_all_listed() -> None:
    with pytest.raises(UnsupportedOpsError) as info:
        capture(WithFFT(), (torch.randn(4, 8),))
    msg = str(info.value)
    fft = next(op for op in info.value.report if "fft" in op.target)
    assert fft.count == 2
    assert "mixer" in msg and "mixer2" in msg and "test_capture.py" in msg
    assert "torch.fft.rfft" in msg
    assert "--allow-replicate-fallback" in msg


def test_fallback_captures_and_reports() -> None:
    graph = capture(WithFFT(), (torch.randn(4, 8),), allow_replicate_fallback=True)
    assert any("fft" in t for t in graph.fallback_ops)
    fallback = [n for n in graph.calls if n.fallback]
    assert len(fallback) >= 2 and all("fft" in n.target or n.target in graph.fallback_ops for n in fallback)
    assert summarize(graph)["fallback_ops"]


def test_non_scalar_output_is_rejected() -> None:
    with pytest.raises(CaptureError, match="one scalar loss"):
        capture(nn.Linear(3, 2), (torch.randn(4, 3),))


def test_export_failure_is_a_capture_error() -> None:
    class DataDependent(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum() if x.sum().item() > 0 else -x.sum()

    with pytest.raises(CaptureError, match="torch.export could not trace"):
        capture(DataDependent(), (torch.randn(3),))
