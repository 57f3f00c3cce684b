"""HuggingFace mixture-of-experts models with transformers' default experts implementation
(sort by expert, histc, grouped matmul: instruction_set.rules.moe) capture and plan without
`--allow-replicate-fallback`, and the grouped-matmul and histc rules compute the op."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

from hetsynth import plan
from hetsynth.zoo.hf import LossOnly
from hetsynth.instruction_set.graph import Node, TensorMeta
from hetsynth.instruction_set.interpret import graph_inputs, run_graph
from hetsynth.instruction_set.layouts import P, R, Layout
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.instruction_set.rules import is_supported, rules_for
from hetsynth.instruction_set.rules.moe import flop_formulas
from hetsynth.planner.capture import capture

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")  # defines the transformers:: grouped-matmul ops

SIZES = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, num_experts_per_tok=2, use_cache=False)
CONFIGS: dict[str, Callable[[], object]] = {
    "mixtral": lambda: transformers.MixtralConfig(num_local_experts=4, **SIZES),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=16,
                                                     shared_expert_intermediate_size=32, **SIZES),
    "olmoe": lambda: transformers.OlmoeConfig(num_experts=4, **SIZES),
    # shared and routed experts, latent attention (one key/value head per head)
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**(SIZES | dict(
        num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=16, n_group=1,
        topk_group=1, first_k_dense_replace=0, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8))),
}
CLUSTER = Path(__file__).parents[1] / "configs" / "clusters" / "local-emulated.toml"
MOE_OPS = {"aten.histc.default", "transformers.grouped_mm_fallback.default"}


def _model(kind: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](), attn_implementation="sdpa")
    tokens = torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    return LossOnly(model), (tokens, tokens.clone())


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_default_experts_capture_with_rules_and_compute_the_loss(kind: str) -> None:
    model, inputs = _model(kind)
    graph = capture(model, inputs)
    targets = {n.target for n in graph.calls}
    assert MOE_OPS <= targets and all(is_supported(t) for t in targets)
    grouped = [n for n in graph.calls if n.target == "transformers.grouped_mm_fallback.default"]
    assert all(n.flops_fwd > 0 and n.flops_bwd == 2 * n.flops_fwd for n in grouped)
    got = run_graph(graph, graph_inputs(graph, model, inputs))
    torch.testing.assert_close(got, model(*inputs), rtol=1e-5, atol=1e-5)


def test_mixtral_plans_without_fallback() -> None:
    model, inputs = _model("mixtral")
    made = plan(model, inputs, str(CLUSTER), num_devices=2, ratios=[0.75, 0.25])
    assert made.predicted.step_time_s > 0 and not any(n.fallback for n in made.graph.calls)


def _split(t: torch.Tensor, layout: Layout, lengths: list[int], gen: torch.Generator) -> list[torch.Tensor]:
    """The ranks' pieces of `t` under a one-level layout (P: random summands)."""
    if layout is R:
        return [t] * len(lengths)
    if layout is P:
        parts = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for _ in lengths[1:]]
        return [t - sum(parts)] + parts
    size, d = t.shape[layout.shard_dim], layout.shard_dim
    ends = [round(size * sum(lengths[:i + 1]) / sum(lengths)) for i in range(len(lengths))]
    return [t.narrow(d, a, b - a) for a, b in zip([0] + ends[:-1], ends)]


def _combine(outs: list[torch.Tensor], layout: Layout) -> torch.Tensor:
    if layout is R:
        assert all(torch.equal(o, outs[0]) for o in outs)
        return outs[0]
    return sum(outs) if layout is P else torch.cat(outs, dim=layout.shard_dim)


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))


def _check_rules(op: Callable, inputs: tuple[torch.Tensor, ...], target: str, args: tuple = ()) -> int:
    metas = tuple(_meta(t) for t in inputs)
    out = op(*inputs, *args)
    node = Node(name="n", op="call", target=target, inputs=tuple(f"i{k}" for k in range(len(inputs))),
                args=tuple({"ref": f"i{k}"} for k in range(len(inputs))) + args, kwargs={},
                outputs=(_meta(out),))
    gen, rules = torch.Generator().manual_seed(0), rules_for(node, metas)
    for rule in rules:
        pieces = [_split(t, lay, [3, 0, 1], gen) for t, lay in zip(inputs, rule.inputs)]
        outs = [op(*(p[rank] for p in pieces), *args) for rank in range(3)]
        torch.testing.assert_close(_combine(outs, rule.output), out, rtol=1e-9, atol=1e-9, msg=str(rule))
    return len(rules)


def test_grouped_mm_rules_compute_the_op() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(10, 6, generator=gen, dtype=torch.float64)
    w = torch.randn(4, 6, 5, generator=gen, dtype=torch.float64)
    offs = torch.tensor([3, 3, 7, 10], dtype=torch.int32)  # expert 1 gets no rows
    op = torch.ops.transformers.grouped_mm_fallback
    assert _check_rules(op, (x, w, offs), "transformers.grouped_mm_fallback.default") == 5


def test_histc_rules_need_an_explicit_range() -> None:
    values = torch.tensor([[0.0, 3.0, 1.0], [2.0, 2.0, 3.0]], dtype=torch.float64)
    assert _check_rules(torch.histc, (values,), "aten.histc.default", (4, 0, 3)) == 3
    assert _check_rules(torch.histc, (values,), "aten.histc.default", (4, 0, 0)) == 1


def test_grouped_mm_flops_are_counted() -> None:
    assert torch.ops.transformers.grouped_mm_fallback in flop_formulas()
    assert torch.ops.aten._grouped_mm in flop_formulas()


@pytest.mark.parametrize("model_type, experts", [("mixtral", "num_local_experts"), ("qwen2_moe", "num_experts"),
                                                 ("olmoe", "num_experts"), ("deepseek_v3", "n_routed_experts")])
def test_hf_refs_get_four_experts_two_per_token(model_type: str, experts: str) -> None:
    attrs = parse_model_ref(f"hf:{model_type}").config.attrs
    assert attrs[experts] == 4 and attrs["num_experts_per_tok"] == 2


def test_hf_deepseek_latent_attention_sizes_agree() -> None:
    """DeepSeek's rotary part is its head_dim, and latent attention has a key/value head per head."""
    attrs = parse_model_ref("hf:deepseek_v3,num_heads=8,hidden=64").config.attrs
    assert attrs["head_dim"] == attrs["qk_rope_head_dim"] and attrs["num_key_value_heads"] == 8
    assert parse_model_ref("hf:deepseek_v3,num_kv_heads=2").config.attrs["num_key_value_heads"] == 2


def test_hf_experts_implementation_is_an_option() -> None:
    assert parse_model_ref("hf:mixtral").config.experts == "batched_mm"
    assert parse_model_ref("hf:mixtral,experts=grouped_mm").config.experts == "grouped_mm"
    with pytest.raises(ValueError, match="experts=eager"):
        parse_model_ref("hf:mixtral,experts=eager")
