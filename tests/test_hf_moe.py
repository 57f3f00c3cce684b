"""HuggingFace mixture-of-experts models with transformers' default experts implementation
(sort by expert, histc, grouped matmul: instruction_set.rules.moe) capture and plan without
`--allow-replicate-fallback`, and the grouped-matmul and histc rules compute the op."""

from __future__ import annotations


from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

from hetsynth import capture_model, plan
from hetsynth.zoo.hf import LossOnly
from hetsynth.instruction_set.graph import Node, TensorMeta
from hetsynth.instruction_set.interpret import graph_inputs, run_graph
from hetsynth.instruction_set.layouts import P, R, Layout
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.instruction_set.rules import is_supported, rules_for
from hetsynth.instruction_set.rules.moe import flop_formulas
from hetsynth.planner.capture import capture
from thread_exchange import ThreadExchange, together

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
@pytest.mark.slow
def test_default_experts_capture_with_rules_and_compute_the_loss(kind: str) -> None:
    model, inputs = _model(kind)
    graph = capture(model, inputs)
    targets = {n.target for n in graph.calls}
    assert MOE_OPS <= targets and all(is_supported(t) for t in targets)
    grouped = [n for n in graph.calls if n.target == "transformers.grouped_mm_fallback.default"]
    assert all(n.flops_fwd > 0 and n.flops_bwd == 2 * n.flops_fwd for n in grouped)
    got = run_graph(graph, graph_inputs(graph, model, inputs))
    torch.testing.assert_close(got, model(*inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
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
    assert parse_model_ref("hf:mixtral").config.experts == "routed"
    assert parse_model_ref("hf:mixtral,experts=batched_mm").config.experts == "batched_mm"
    assert parse_model_ref("hf:mixtral,experts=grouped_mm").config.experts == "grouped_mm"
    with pytest.raises(ValueError, match="experts=eager"):
        parse_model_ref("hf:mixtral,experts=eager")


def _routed_inputs(num_experts: int = 5) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:2] for _ in range(7)])
    idx[:, 0] = torch.where(idx[:, 0] == 1, 0, idx[:, 0])  # expert 1 gets fewer pairs
    w = torch.rand(7, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    gate_up = torch.randn(num_experts, 8, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    down = torch.randn(num_experts, 6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    return x, idx, w, gate_up, down


def test_routed_experts_split_by_experts_sums_to_the_op() -> None:
    """The expert-parallel rule (x, idx, w R; experts S(0) -> P): ranks holding 3, 0, 2 of 5
    experts, each running the op with its first expert, sum to the op, gradients too."""
    x, idx, w, gate_up, down = _routed_inputs()
    op = torch.ops.hetsynth.routed_experts
    want = op(x, idx, w, gate_up, down, "silu", 0)
    grads = torch.autograd.grad(want.sum(), (x, w, gate_up, down))
    pieces, first = [], 0
    for count in (3, 0, 2):
        pieces.append(op(x, idx, w, gate_up[first:first + count], down[first:first + count], "silu", first))
        first += count
    got = sum(pieces)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, h in zip(torch.autograd.grad(got.sum(), (x, w, gate_up, down)), grads):
        torch.testing.assert_close(g, h, rtol=1e-12, atol=1e-12)
    node = Node(name="n", op="call", target="hetsynth.routed_experts.default", inputs=("a", "b", "c", "d", "e"),
                args=tuple({"ref": r} for r in "abcde") + ("silu", 0), kwargs={}, outputs=(_meta(want),))
    rules = rules_for(node, tuple(_meta(t) for t in (x, idx, w, gate_up, down)))
    assert [r.local for r in rules if r.output is P] == ["experts_sharded"]


def test_dispatched_experts_on_three_members_are_the_op() -> None:
    """Tokens 3 : 0 : 4 and experts 2 : 3 : 0 of 5 over three members (one with no tokens,
    one with no experts), pairs exchanged between threads: the members' rows are the op's
    rows and the gradients of every input are the op's, in float64 to the last bits (k = 2)."""
    from hetsynth.instruction_set.experts_op import dispatched_math
    from hetsynth.runtime.experts import expert_starts

    x, idx, w, gate_up, down = _routed_inputs()
    want = torch.ops.hetsynth.routed_experts(x, idx, w, gate_up, down, "silu", 0)
    seed = torch.randn(want.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = torch.autograd.grad(want, (x, w, gate_up, down), seed)
    tokens, starts = expert_starts([3, 0, 4]), expert_starts([2, 3, 0])
    hub = ThreadExchange(3)

    def member(m: int) -> tuple:
        t, e = slice(tokens[m], tokens[m + 1]), slice(starts[m], starts[m + 1])
        out = dispatched_math(x[t], idx[t], w[t], gate_up[e], down[e], "silu", starts, m, hub.member(m))
        return out, torch.autograd.grad(out, (x, w, gate_up, down), seed[t], allow_unused=True)

    results = together([lambda m=m: member(m) for m in range(3)], hub)
    torch.testing.assert_close(torch.cat([out for out, _ in results]), want, rtol=1e-13, atol=1e-13)
    for i, g in enumerate(grads):
        got = sum(r[i] for _, r in results if r[i] is not None)
        torch.testing.assert_close(got, g, rtol=1e-12, atol=1e-12)


class Loopback:
    """One member's exchange: everything it sends, it receives."""

    def counts(self, send: list[int]) -> list[int]:
        return send

    def rows(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        return rows


def test_dispatched_experts_under_autocast_and_without_pairs() -> None:
    """Under bfloat16 autocast the dispatched op adds 16-bit expert rows into float32 ones (as
    the op does); experts no pair reaches still get a gradient (zeros, as on one device), so
    that every member's weights step and every member joins the exchanges' backward."""
    from hetsynth.instruction_set.experts_op import dispatched_math, routed_experts_math

    x, idx, w, gate_up, down = (t.float().detach().requires_grad_(t.requires_grad) for t in _routed_inputs())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = dispatched_math(x, idx, w, gate_up, down, "silu", (0, 5), 0, Loopback())
        want = routed_experts_math(x, idx, w, gate_up, down, "silu", 0)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    x, idx, w, gate_up, down = _routed_inputs()
    unused = dispatched_math(x, idx % 3, w, gate_up[3:], down[3:], "silu", (3, 5), 0, Loopback())
    grads = torch.autograd.grad(unused.sum(), (gate_up, down))
    assert all(g is not None and not g.any() for g in grads)


def test_dispatched_rule_splits_tokens_and_experts_apart() -> None:
    """The rule with tokens and experts split keeps them in separate ratio classes (the
    experts are its work inputs) and charges its two all-to-alls."""
    x, idx, w, gate_up, down = _routed_inputs()
    want = torch.ops.hetsynth.routed_experts(x, idx, w, gate_up, down, "silu", 0)
    node = Node(name="n", op="call", target="hetsynth.routed_experts.default", inputs=("a", "b", "c", "d", "e"),
                args=tuple({"ref": r} for r in "abcde") + ("silu", 0), kwargs={}, outputs=(_meta(want),))
    rules = rules_for(node, tuple(_meta(t) for t in (x, idx, w, gate_up, down)))
    dispatched = [r for r in rules if r.local == "experts_dispatched"]
    assert len(dispatched) == 1 and dispatched[0].work_inputs == (3, 4)
    from hetsynth.planner.problem import rule_links

    links = rule_links(node, dispatched)
    assert ("n", 0) not in {b for a, b in links if a == ("d", 0)} and (("d", 0), ("e", 0)) in links
    assert (("n", 0), ("a", 0)) in links


def test_routed_experts_backward_is_autograd_of_its_math() -> None:
    from hetsynth.instruction_set.experts_op import routed_experts_math

    x, idx, w, gate_up, down = _routed_inputs()
    for act in ("silu", "gelu", "relu", "gelu_pytorch_tanh"):
        op = torch.ops.hetsynth.routed_experts(x, idx, w, gate_up, down, act, 0)
        ref = routed_experts_math(x, idx, w, gate_up, down, act, 0)
        seed = torch.randn(op.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        for g, h in zip(torch.autograd.grad(op, (x, w, gate_up, down), seed),
                        torch.autograd.grad(ref, (x, w, gate_up, down), seed)):
            torch.testing.assert_close(g, h, rtol=1e-12, atol=1e-12, msg=act)


@pytest.mark.slow
def test_routed_experts_match_transformers_with_the_router_loss() -> None:
    """`experts=routed` computes what transformers' batched_mm does, loss (with the router's
    auxiliary loss) and gradients, and captures as one op with FLOPs and rules."""
    from hetsynth.instruction_set.models import parse_model_ref

    ref = "hf:mixtral,dtype=float64,num_local_experts=8,output_router_logits=true,router_aux_loss_coef=0.5"
    results = []
    for experts in ("batched_mm", "routed"):
        spec = parse_model_ref(f"{ref},experts={experts}")
        torch.manual_seed(0)
        model = spec.build()
        loss = model(*spec.make_batch(list(range(8)), 0))
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert abs(loss_a - loss_b) <= 1e-12 * abs(loss_a)
    assert max(float((grads_a[n] - grads_b[n]).abs().max()) for n in grads_a) <= 1e-12
    graph = capture(*_spec_module(parse_model_ref(f"{ref},experts=routed")))
    routed = [n for n in graph.calls if n.target == "hetsynth.routed_experts.default"]
    assert len(routed) == 2 and all(n.flops_fwd > 0 and n.flops_bwd == 2 * n.flops_fwd for n in routed)


def _spec_module(spec) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return spec.build(), spec.example_inputs("cpu")


def test_a_number_taken_out_of_a_tensor_is_a_capture_error() -> None:
    """JetMoE's experts split the tokens by per-expert sizes taken out with `.tolist()`: the
    shapes after it depend on the batch's values; capture says so, naming the op and the
    line, instead of failing on the symbol export recorded."""
    from hetsynth.planner.capture import CaptureError

    with pytest.raises(CaptureError, match=r"aten._local_scalar_dense.default at .*experts.*tolist\(\)\) turns a "
                                           r"tensor into a Python number"):
        capture_model("hf:jetmoe")


def test_a_model_transformers_cannot_build_is_a_model_ref_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' own code failing on the config it made (DbrxAttentionConfig without
    rope_theta, transformers 5.25) is an error naming the model type and the version, not a
    traceback."""
    from hetsynth.instruction_set.models import ModelRefError, parse_model_ref

    def broken(*args, **kwargs):
        raise AttributeError("'LlamaConfig' object has no attribute 'rope_theta'")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", broken)
    with pytest.raises(ModelRefError, match=rf"hf:llama: transformers {transformers.__version__} cannot build this "
                                            r"model from its config \(AttributeError: .*rope_theta"):
        parse_model_ref("hf:llama").build("meta")
