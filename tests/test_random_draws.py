"""Random draws under sharding keep one device's values (instruction_set.local.draw_whole):
each rank draws the op's whole tensor from a generator in one device's state and keeps its
window, so dropout, bernoulli, rand_like, exponential, uniform and attention's dropout give the
single-device values at every position, the generator ends where one device's does, and a
model with dropout trains exactly as on one device under a plan that splits its activations by
rows or by columns. Pipelines: tests/test_pipeline_parity.py."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from hetsynth import capture_model
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.instruction_set.graph import Node, TensorMeta
from hetsynth.instruction_set.interpret import run_target
from hetsynth.instruction_set.local import RANDOM_DRAWS, SDPA, EagerBuilder, LocalContext, emit_local
from hetsynth.planner.planner import make_plan
from hetsynth.planner.problem import Restrictions
from hetsynth.runtime.check import check_on_pool
from hetsynth.runtime.config import TrainConfig

SEED = 7
CLUSTER = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "local-emulated.toml"

# target -> (args after the tensor, kwargs)
CASES: dict[str, tuple[tuple, dict]] = {
    "aten.native_dropout.default": ((0.3, True), {}),
    "aten.dropout.default": ((0.3, True), {}),
    "aten.bernoulli.p": ((0.4,), {}),
    "aten.rand_like.default": ((), {}),
    "aten.randn_like.default": ((), {}),
    "aten.exponential.default": ((), {}),
    "aten.uniform.default": ((-2.0, 3.0), {}),
}


def test_every_random_draw_has_a_case() -> None:
    assert set(CASES) == set(RANDOM_DRAWS)


def _node(target: str, x: torch.Tensor, args: tuple, kwargs: dict) -> Node:
    out = run_target(target)(x, *args, **kwargs)
    outs = list(out) if isinstance(out, tuple) else [out]
    meta = lambda t: TensorMeta(shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."),
                                requires_grad=t.is_floating_point())
    return Node(name="op", op="call", target=target, args=({"ref": "x"}, *args), kwargs=kwargs, inputs=("x",),
                outputs=tuple(meta(t) for t in outs), multi_output=isinstance(out, tuple))


def _rank(node: Node, x: torch.Tensor, dim: int, start: int, length: int) -> tuple[list[torch.Tensor], float]:
    """One rank's outputs for rows [start, start + length) of `dim`, and the generator's next value."""
    torch.manual_seed(SEED)
    shapes = []
    for m in node.outputs:
        shape = list(m.shape)
        shape[dim] = length
        shapes.append(tuple(shape))
    ctx = LocalContext(tuple(shapes), starts={dim: start})
    out = emit_local(node, "", [x.narrow(dim, start, length)], ctx, EagerBuilder())
    return (list(out) if isinstance(out, tuple) else [out]), torch.rand(()).item()


@pytest.mark.parametrize("target", sorted(CASES))
@pytest.mark.parametrize("dim,lengths", [(0, (1, 3)), (1, (2, 0, 4)), (1, (6,))])
def test_sharded_draw_is_one_devices(target: str, dim: int, lengths: tuple[int, ...]) -> None:
    """Ranks holding uneven windows of either dim (one of them empty) put together the whole
    draw of one device, and each rank's generator is then where one device's is."""
    args, kwargs = CASES[target]
    x = torch.rand(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) + 0.5
    node = _node(target, x, args, kwargs)
    torch.manual_seed(SEED)
    want = run_target(target)(x, *args, **kwargs)
    want = list(want) if isinstance(want, tuple) else [want]
    after = torch.rand(()).item()
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    ranks = [_rank(node, x, dim, s, n) for s, n in zip(starts, lengths)]
    for k, w in enumerate(want):
        got = torch.cat([outs[k] for outs, _ in ranks], dim=dim)
        torch.testing.assert_close(got.to(w.dtype), w, rtol=1e-15, atol=0,
                                   msg=lambda m: f"{target} output {k} split {lengths} on dim {dim}: {m}")
    assert all(next_value == after for _, next_value in ranks), (target, [v for _, v in ranks], after)


@pytest.mark.parametrize("target", ["aten.native_dropout.default", "aten.dropout.default"])
@pytest.mark.parametrize("p,train", [(0.0, True), (0.5, False)])
def test_dropout_that_drops_nothing_draws_nothing(target: str, p: float, train: bool) -> None:
    """Eager dropout with p = 0 or not training draws nothing (aten.native_dropout would draw a
    mask of ones): a rank neither, so a later draw gets one device's values."""
    x = torch.rand(4, 6, dtype=torch.float64)
    node = _node(target, x, (p, train), {})
    (out, *_), next_value = _rank(node, x, 0, 1, 2)
    torch.manual_seed(SEED)
    torch.nn.functional.dropout(x, p, train)
    assert next_value == torch.rand(()).item()
    torch.testing.assert_close(out, x[1:3], rtol=0, atol=0)


@pytest.mark.parametrize("causal,gqa,mask", [(False, False, False), (True, False, False), (False, True, True)])
def test_attention_dropout_on_a_window_is_one_devices(causal: bool, gqa: bool, mask: bool) -> None:
    """scaled_dot_product_attention with dropout, on ranks holding uneven windows of the batch
    or of the heads (grouped-query heads split by groups; a boolean mask): each rank draws the
    whole weights' mask and keeps its window, and the parts put together are one device's
    output, with the generator where one device's is after it."""
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, s, e = 3, 4, (2 if gqa else 4), 5, 4
    q = torch.randn(b, hq, s, e, dtype=torch.float64, generator=g)
    k, v = (torch.randn(b, hkv, s, e, dtype=torch.float64, generator=g) for _ in range(2))
    attn_mask = torch.rand(b, 1, s, s, generator=g) > 0.3 if mask else None
    if attn_mask is not None:
        attn_mask[..., 0] = True  # no row without a key
    kwargs = dict(attn_mask=attn_mask, dropout_p=0.3, is_causal=causal, enable_gqa=gqa)
    torch.manual_seed(SEED)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    after = torch.rand(()).item()
    node = Node(name="attn", op="call", target=SDPA, args=({"ref": "q"}, {"ref": "k"}, {"ref": "v"}),
                kwargs={"attn_mask": {"ref": "m"} if mask else None, "dropout_p": 0.3, "is_causal": causal,
                        "enable_gqa": gqa},
                inputs=("q", "k", "v", "m") if mask else ("q", "k", "v"),
                outputs=(TensorMeta(shape=tuple(want.shape), dtype="float64", requires_grad=True),))
    for dim, lengths in ((0, (1, 0, 2)), (1, (2, 0, 2))):
        parts = []
        for i, n in enumerate(lengths):
            start = sum(lengths[:i])
            kv_start, kv_n = (start // (hq // hkv), n // (hq // hkv)) if dim == 1 else (start, n)
            local = [q.narrow(dim, start, n), k.narrow(dim, kv_start, kv_n), v.narrow(dim, kv_start, kv_n)]
            if mask:
                local.append(attn_mask.narrow(0, start, n) if dim == 0 else attn_mask)
            shape = list(want.shape)
            shape[dim] = n
            torch.manual_seed(SEED)
            ctx = LocalContext((tuple(shape),), starts={dim: start})
            parts.append(emit_local(node, "", local, ctx, EagerBuilder()))
            assert torch.rand(()).item() == after, (dim, lengths, i)
        torch.testing.assert_close(torch.cat(parts, dim), want, rtol=1e-12, atol=1e-12)


DROPOUT_MODEL = """
import torch
from torch import nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 64)
        self.drop = nn.Dropout(0.25)
        self.b = nn.Linear(64, 4)

    def forward(self, x, y):
        h = self.drop(F.relu(self.a(x)))
        noisy = h * torch.rand_like(h)  # a second draw, after the first
        return F.cross_entropy(self.b(noisy), y)


def make():
    g = torch.Generator().manual_seed(0)
    return Net(), (torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))
"""


@pytest.mark.slow
@pytest.mark.parametrize("split", ["rows", "columns"])
def test_dropout_model_trains_as_on_one_device(pools, tmp_path: Path, split: str) -> None:
    """A model with dropout and a rand_like, 4 ranks at ratios 0.4/0.3/0.2/0.1, its activations
    split by rows (the batch) or by columns (the hidden dim, forced): float64 within 1e-9."""
    path = tmp_path / "dropout_model.py"
    path.write_text(textwrap.dedent(DROPOUT_MODEL))
    graph = capture_model(f"{path}:make")
    drops = [n.name for n in graph.calls if n.target == "aten.native_dropout.default"]
    assert len(drops) == 1, [n.target for n in graph.calls]
    force: dict[str, Any] = {drops[0]: "S1"} if split == "columns" else {}
    plan = make_plan(graph, load_cluster(CLUSTER), ratios=[0.4, 0.3, 0.2, 0.1], progress=False,
                     with_baselines=False, restrictions=Restrictions(force=force))
    made = next(i.layout for i in plan.instructions if i.kind == "compute" and i.node == drops[0])
    assert made.shard_dim == (1 if split == "columns" else 0), made
    float32, float64 = check_on_pool(pools.get(4), plan, TrainConfig(steps=2, lr=1e-2))
    assert float64.ok, float64.describe()
    assert float32.ok, float32.describe()


@pytest.mark.slow
def test_gpt_with_dropout_trains_as_on_one_device(pools) -> None:
    """The zoo's GPT with dropout 0.1 (residual dropout, and attention dropout inside
    scaled_dot_product_attention) on 4 ranks at uneven ratios: float64 within 1e-9."""
    graph = capture_model("gpt:tiny,dropout=0.1")
    assert any(n.target == SDPA for n in graph.calls)
    plan = make_plan(graph, load_cluster(CLUSTER), ratios=[0.4, 0.3, 0.2, 0.1], progress=False,
                     with_baselines=False)
    float32, float64 = check_on_pool(pools.get(4), plan, TrainConfig(steps=2, lr=1e-2))
    assert float64.ok, float64.describe()


def test_a_whole_draw_is_counted_in_the_working_set() -> None:
    """Every rank holds a random op's whole draw while it makes it: the attention weights' mask
    of GPT with attention dropout ([B, H, L, L], twice: the ones and the draw) is counted in the
    plan's transient working set; without dropout nothing is drawn."""
    from hetsynth.instruction_set.local import whole_draw_bytes
    from hetsynth.planner.problem import Problem
    from hetsynth.planner.step_cost import op_working_set

    graph = capture_model("gpt:tiny,dropout=0.1")
    attn = next(n for n in graph.calls if n.target == SDPA)
    b, h, l, _ = attn.outputs[0].shape
    assert whole_draw_bytes(graph, attn) == 2 * b * h * l * l * 4
    plain = capture_model("gpt:tiny")
    assert whole_draw_bytes(plain, next(n for n in plain.calls if n.target == SDPA)) == 0
    cluster, ratios = load_cluster(CLUSTER), [0.4, 0.3, 0.2, 0.1]
    plan = make_plan(graph, cluster, ratios=ratios, progress=False, with_baselines=False)
    working = op_working_set(Problem(graph, cluster, ratios), plan.instructions)
    assert working is not None and min(working.fixed) >= 2 * b * h * l * l * 4
