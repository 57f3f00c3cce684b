"""Sequence-parallel activations (Megatron-SP) train like one device.

Inside a tensor-parallel block the residual stream, the layer norms and the residual adds run
on token-split layouts S(1) of [B, T, H] activations, so no rank holds a replicated copy:
the row-parallel linears' Partial outputs are reduce-scattered onto tokens (P -> S1) and the
column-parallel linears read tokens all-gathered (S1 -> R), the pair that replaces the
all-reduce (same bytes on the wire, 1/n of the activations stored). Layouts are forced on the
attention and MLP linears and the residual adds; the search places the norms and the
collectives. Each case trains 5 AdamW steps with clipping in float64 against one device (loss
1e-9 relative, parameters 1e-8), with even, uneven and zero-length token shards, with and
without the fused ring (ag_matmul from S1, matmul_rs to S1).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hetsynth.instruction_set.graph import ReferenceGraph
from hetsynth.instruction_set.layouts import S
from hetsynth.instruction_set.plan import Plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fused_parity import SHAPES, errors, single_device, trained  # noqa: E402
from test_parity import make, nodes  # noqa: E402

# (attention module, MLP module, the module holding the blocks' residual adds)
MODULES = {"gpt": ("attn", "ffn", "blocks"), "bert": ("attn", "ffn", "layers"), "vit": ("attn", "ffn", "blocks")}


def _linears(g: ReferenceGraph, module: str, layout: str) -> dict[str, str]:
    return {n: layout for n in nodes(g, "aten.linear.default", module)}


def _row_parallel(g: ReferenceGraph, module: str) -> dict[str, str]:
    """`module`'s linears Partial, the clones (dropout with p = 0) of their outputs token-split:
    the reduce-scatter follows the linear itself."""
    rows = _linears(g, module, "P")
    return rows | {n.name: "S1" for n in g.calls if n.target == "aten.clone.default" and n.inputs[0] in rows}


def sequence_parallel(g: ReferenceGraph, model: str) -> dict[str, str]:
    """Head-parallel attention (q, k, v column-parallel, out row-parallel), a column/row MLP,
    the residual adds of every block token-split."""
    attn, mlp, blocks = MODULES[model]
    columns = {f"{attn}.{p}" for p in ("query", "key", "value")} | {f"{mlp}.fc1"}
    force = {n: layout for m in columns for n, layout in _linears(g, m, "S2").items()}
    return (force | _row_parallel(g, f"{attn}.out") | _row_parallel(g, f"{mlp}.fc2")
            | {n: "S1" for n in nodes(g, "aten.add.Tensor", blocks)})


def sp_plan(model: str, ratios: list[float], fusion: bool) -> Plan:
    from hetsynth import capture_model
    from hetsynth.planner.problem import Restrictions

    ref = f"{model}:tiny,batch_size=12,dtype=float64"
    force = sequence_parallel(capture_model(ref), model)
    return make(ref, ratios, Restrictions(force=force, two_level=False, allow_fusion=fusion,
                                          force_fusion=fusion))


def token_split_norms(plan: Plan) -> list[str]:
    """The layer-norm instructions the plan computes on token-split activations."""
    norms = {n.name for n in plan.graph.calls if "layer_norm" in n.target or "layer_norm" in n.name}
    return [i.node for i in plan.instructions if i.kind != "param" and i.node in norms and i.layout is S(1)]


CASES = [("gpt", 3, "zero", True), ("bert", 4, "uneven", False), ("vit", 2, "uneven", True)]


@pytest.mark.parametrize("model,world,shape,fusion", CASES)
def test_sequence_parallel_trains_like_one_device(pools, model: str, world: int, shape: str, fusion: bool) -> None:
    plan = sp_plan(model, SHAPES[world][shape], fusion)
    kinds = {(i.kind, str(i.layout)) for i in plan.instructions}
    gathers = {"ag_matmul"} if fusion else {"all_gather"}
    assert any(k in gathers for k, _ in kinds) and token_split_norms(plan), sorted(kinds)
    assert ("matmul_rs", "S1") in kinds if fusion else ("reduce_scatter", "S1") in kinds, sorted(kinds)
    loss, param = errors(trained(pools, plan), single_device(plan))
    print(f"{model} world={world} {shape} fusion={fusion}: loss {loss:.2e} params {param:.2e}")
    assert loss <= 1e-9 and param <= 1e-8, (loss, param)


def test_search_reaches_sequence_parallel_activations_when_memory_is_tight(caplog) -> None:
    """One sequence on four devices: a batch split cannot share the activations (one rank would
    hold the whole batch), so with 0.0002 GiB each (the replicated plan needs 0.00047) the
    planner's plan puts the blocks' layer norms and residual adds on tokens, between
    reduce-scatters onto tokens and gathers of them. It is the fastest program of the first
    search that fits (faster than the replicated program made to fit by ZeRO-3 and
    recomputation); no memory penalty is needed. The summary says so."""
    import logging

    from hetsynth import capture_model
    from hetsynth.report import plan_summary_text
    from hetsynth.instruction_set.cluster import cluster_from_dict
    from hetsynth.planner.planner import make_plan

    cluster = cluster_from_dict({"name": "tight", "device_kinds": {"small": {"throughput_flops": 1e12, "memory_gib": 2e-4}},
                                 "nodes": [{"name": "n", "kind": "small", "num_devices": 4}],
                                 "links": {"intra_node_bandwidth_gbps": 100, "inter_node_bandwidth_gbps": 10}})
    with caplog.at_level(logging.INFO, logger="hetsynth.planner.planner"):
        plan = make_plan(capture_model("gpt:tiny,batch_size=1"), cluster, progress=False, with_baselines=False)
    assert plan.predicted.fits and "memory penalty" not in caplog.text
    assert len(token_split_norms(plan)) >= 4, token_split_norms(plan)  # both blocks' ln1 and ln2
    onto_tokens = [i for i in plan.instructions if i.kind in ("reduce_scatter", "matmul_rs") and i.layout is S(1)]
    assert len(onto_tokens) >= 4, [i.describe() for i in plan.instructions]
    assert f"sequence-parallel activations ({len(token_split_norms(plan))} of 5 layer norms token-split)" \
        in plan_summary_text(plan)
