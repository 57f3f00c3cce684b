"""Capture into the reference graph: shapes, FLOPs, unsupported ops, fallback, HF models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hetsynth import capture_model
from hetsynth.instruction_set.interpret import graph_inputs, run_graph
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.instruction_set.rules import is_supported
from hetsynth.planner.capture import CaptureError, UnsupportedOpsError, capture, summarize

ZOO_TINY = ["gpt:tiny", "bert:tiny", "vit:tiny", "vgg:tiny", "moe:tiny"]


@pytest.mark.parametrize("ref", ZOO_TINY + ["hf-gpt2:tiny", "hf-bert:tiny"])
@pytest.mark.slow
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


@pytest.mark.slow
def test_gpt2_small_flops_match_6nd() -> None:
    for ref in ["gpt:tiny", "gpt:small"]:
        spec = parse_model_ref(ref)
        graph = capture_model(ref)
        tokens = spec.batch_size * spec.config.seq_len
        estimate = 6 * graph.num_params * tokens
        assert abs(sum(graph.flops) / estimate - 1) < 0.25, (ref, sum(graph.flops), estimate)
        fwd, bwd = graph.flops
        assert 1.8 < bwd / fwd < 2.2


@pytest.mark.slow
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
    # views replay as the runtime runs them (reshapes): the view of the permuted attention
    # output keeps its gradient, so the output projection's backward counts dX as well as dW
    views = [n for n in graph.calls if n.target == "aten.view.default" and n.out.requires_grad]
    assert len(views) >= 8 and all(n.flops_bwd == 2 * n.flops_fwd for n in linears)


@torch.library.custom_op("hetsynth_test::spectral", mutates_args=())
def spectral(x: torch.Tensor) -> torch.Tensor:
    """An op outside the op surface (a custom op without a decomposition)."""
    return torch.fft.rfft(x, dim=-1).abs()


@spectral.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2 + 1)


class Spectral(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return spectral(x)


class WithCustomOp(nn.Module):
    def __init__(self, mixers: int = 2, branch: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.mixers = nn.ModuleList(Spectral() for _ in range(mixers))
        self.branch = branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for mixer in self.mixers:
            x = mixer(x)
        if self.branch:
            x = torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t - 1, (x,))
        return (x.sum(-1) ** 2).mean()


@pytest.mark.slow
def test_unsupported_ops_are_all_listed() -> None:
    with pytest.raises(UnsupportedOpsError) as info:
        capture(WithCustomOp(mixers=7, branch=True), (torch.randn(4, 8),))
    msg = str(info.value)
    custom = next(op for op in info.value.report if "spectral" in op.target)
    assert custom.count == 7 and len(custom.places) == 7
    assert "mixers.0" in msg and "mixers.4" in msg and "mixers.5" not in msg and "and 2 more" in msg
    assert "test_capture.py" in msg and "return spectral(x)" in msg
    cond = next(op for op in info.value.report if op.higher_order)
    assert "torch.cond(" in cond.places[0], cond.places
    assert "no replicated fallback" in msg
    with pytest.raises(UnsupportedOpsError, match="cannot fall back"):
        capture(WithCustomOp(branch=True), (torch.randn(4, 8),), allow_replicate_fallback=True)


def test_fallback_captures_and_reports() -> None:
    graph = capture(WithCustomOp(), (torch.randn(4, 8),), allow_replicate_fallback=True)
    assert graph.fallback_ops == ("hetsynth_test.spectral.default",)
    fallback = [n for n in graph.calls if n.fallback]
    assert len(fallback) == 2 and all("spectral" in n.target for n in fallback)
    assert summarize(graph)["fallback_ops"]


class NoGradScale(nn.Module):
    """A no_grad region computed from a parameter: its outputs must not carry a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = self.lin.weight.abs().sum()
        return (self.lin(x) * scale).pow(2).mean()


def test_no_grad_regions_are_inlined_without_gradient() -> None:
    model, x = NoGradScale().double(), torch.randn(3, 4, dtype=torch.float64)
    graph = capture(model, (x,))
    assert all("wrap_with" not in n.target for n in graph.calls)
    detached = [n for n in graph.calls if n.target == "aten.detach.default"]
    assert detached and not detached[0].out.requires_grad
    assert any("scale = self.lin.weight.abs().sum()" in n.source for n in graph.calls)
    model(x).backward()
    expected = model.lin.weight.grad.clone()
    model.zero_grad()
    run_graph(graph, graph_inputs(graph, model, (x,))).backward()
    torch.testing.assert_close(model.lin.weight.grad, expected, rtol=1e-12, atol=1e-12)


def test_non_scalar_output_is_rejected() -> None:
    with pytest.raises(CaptureError, match="one scalar loss"):
        capture(nn.Linear(3, 2), (torch.randn(4, 3),))


def test_export_failure_is_a_capture_error() -> None:
    class DataDependent(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum() if x.sum().item() > 0 else -x.sum()

    with pytest.raises(CaptureError, match="torch.export could not trace"):
        capture(DataDependent(), (torch.randn(3),))


@pytest.mark.slow
def test_tied_weights_are_one_parameter() -> None:
    """export lifts a tied weight once per name; the graph holds it once, so it trains once."""
    spec = parse_model_ref("hf:opt")
    model = spec.build("meta")
    assert len(list(model.parameters())) < len(list(model.named_parameters(remove_duplicate=False)))
    graph = capture_model("hf:opt")
    assert len(graph.params) == len(list(model.parameters()))
    assert not any("lm_head" in n.fqn for n in graph.params)


def test_forward_constants_keep_their_values() -> None:
    class PickLast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)[..., [-2, -1]].sum()

    model = PickLast().double()
    x = torch.randn(3, 6, dtype=torch.float64)
    graph = capture(model, (x,))
    assert [n.value for n in graph.nodes if n.value is not None] == [[-2, -1]]
    torch.testing.assert_close(run_graph(graph, graph_inputs(graph, model, (x,))), model(x))


def _canonical(graph: Any) -> list[str]:
    """Every node as text, tensors named by their position (names differ between traces)."""
    index = {n.name: i for i, n in enumerate(graph.nodes)}

    def sub(x: Any) -> Any:
        if isinstance(x, dict):
            return ["ref", index[x["ref"]]] if "ref" in x else {k: sub(v) for k, v in x.items()}
        return [sub(i) for i in x] if isinstance(x, (list, tuple)) else x

    return [json.dumps([n.op, n.target, sub(list(n.args)), sub(dict(n.kwargs)), [str(o) for o in n.outputs],
                        n.module_path, n.source, n.flops_fwd, n.flops_bwd], default=str) for n in graph.nodes]


@pytest.mark.parametrize("ref, local", [("gpt:tiny", True), ("vgg:tiny", True), ("moe:tiny", True),
                                        ("hf:llama", True), ("resnet:tiny", False)])
@pytest.mark.slow
def test_local_decomposition_equals_the_retrace(ref: str, local: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """hetsynth.planner.decompose_local gives the graph run_decompositions gives (ops, arguments,
    shapes, places, FLOPs); a graph with mutations (BatchNorm's buffers) takes the retrace."""
    import hetsynth.planner.lower as lower

    used = []
    real = lower.decompose_locally
    monkeypatch.setattr(lower, "decompose_locally", lambda *a: used.append(real(*a)) or used[-1])
    fast = _canonical(capture_model(ref))
    monkeypatch.setattr(lower, "decompose_locally", lambda *a: False)
    assert used == [local] and fast == _canonical(capture_model(ref))


class SliceAssigned(nn.Module):
    """Slice assignment into a fresh tensor (as DeepSeek-V3's attention does): torch.export
    records the functional aten.copy, which has no autograd formula of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w
        out = h.new_zeros(h.shape)
        out[..., :3] = h[..., 3:] * 2
        out[..., 3:] = h[..., :3]
        return (out ** 2).sum()


def test_slice_assignment_trains_through_the_graph() -> None:
    torch.manual_seed(0)
    m, x = SliceAssigned(), torch.randn(4, 6, dtype=torch.float64)
    graph = capture(m, (x,), model_ref="SliceAssigned")
    assert "aten.copy.default" in {n.target for n in graph.calls}
    loss = run_graph(graph, graph_inputs(graph, m, (x,)))
    loss.backward()
    got, m.w.grad = m.w.grad.clone(), None
    want = m(x)
    want.backward()
    assert float(loss) == pytest.approx(float(want), rel=1e-12)
    torch.testing.assert_close(got, m.w.grad, rtol=1e-12, atol=1e-12)


CLUSTERS = Path(__file__).resolve().parents[1] / "configs" / "clusters"


class _StraightThrough(torch.autograd.Function):
    """Rounds in the forward; passes the gradient through unchanged (not the forward's derivative)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _Quantized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _StraightThrough.apply(self.fc(x)).pow(2).mean()


def test_custom_autograd_functions_are_recorded_and_named(caplog: pytest.LogCaptureFixture) -> None:
    """torch.export traces a torch.autograd.Function through its forward and keeps no trace of
    its backward: capture records the class, logs a warning, and the plan summary and a failed
    check name it; a model without one records none (torch's own Functions are not counted)."""
    from hetsynth.instruction_set.cluster import load_cluster
    from hetsynth.planner.planner import make_plan
    from hetsynth.report import plan_summary_text
    from hetsynth.runtime.check import compare

    with caplog.at_level("WARNING", logger="hetsynth.planner.capture"):
        graph = capture(_Quantized(), (torch.randn(8, 4),), model_ref="quantized")
    name = f"{__name__}._StraightThrough"
    assert graph.custom_backwards == (name,)
    assert any(name in r.getMessage() and "never runs their backward" in r.getMessage() for r in caplog.records)
    assert capture_model("gpt:tiny").custom_backwards == ()
    failed = compare("float64", [1.0], [1.1], {}, {}, (1e-9, 1e-8), custom_backwards=graph.custom_backwards)
    assert not failed.ok and name in failed.describe()
    passed = compare("float64", [1.0], [1.0], {}, {}, (1e-9, 1e-8), custom_backwards=graph.custom_backwards)
    assert passed.ok and name not in passed.describe()
    plan = make_plan(graph, load_cluster(CLUSTERS / "local-emulated.toml"), progress=False, with_baselines=False)
    assert any(line.startswith("warning") and name in line for line in plan_summary_text(plan).splitlines())
