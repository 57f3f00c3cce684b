"""Fused collective-matmuls (ag_matmul, matmul_rs) inside plans of the zoo's models train like
one device: 5 AdamW steps with global-norm clipping in float64, the loss within 1e-9 relative
and the reassembled parameters within 1e-8 (as tests/test_parity.py), at world sizes 2, 3 and 4
with even, uneven and zero-length shards (first, middle, last), forward and backward (each
fused kind's backward is the other kind's ring), with the ring and with k-slicing.

Each model's plan is forced into tensor parallelism with the residual stream split by batch
(Megatron's sequence-parallel pair): the first linear reads an all-gathered activation
(-> ag_matmul; later readers of the same x, such as k and v after q, read x_full free), the
second's Partial output is reduce-scattered (-> matmul_rs). `FORCE` says per model which
linears, and why where a model has only one of the two kinds. The batch is 12, so the even
shapes are truly even at every world size.

Not here: hf-gpt2, whose blocks have no fusable pair (test_hf_gpt2_blocks_have_no_fusable_pair)
and whose loss is computed in float32 (`logits.float()`), so no batch-split plan of it matches
one device within 1e-9, fused or not; hf:llama computes in float32 too (RMSNorm, the loss), so
its fused plans are compared with their unfused twins instead (`FLOAT32_INSIDE`).

The default suite runs `SUBSET` (every world size and shard shape, every variant, ~30 s);
`HETSYNTH_FUSED_MATRIX=1` runs `MATRIX` (every model x world x shape with the ring, and the
zero-length shapes of worlds 3 and 4 with k-slicing).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

import pytest

from hetsynth.instruction_set.graph import ReferenceGraph
from hetsynth.instruction_set.plan import Plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_parity import CONFIG, make, nodes, train_worker  # noqa: E402

# multi-process or seconds long: make test runs them, make test-fast does not
pytestmark = pytest.mark.slow

FUSED = ("ag_matmul", "matmul_rs")


def _linears(g: ReferenceGraph, module: str, layout: str) -> dict[str, str]:
    return {n: layout for n in nodes(g, "aten.linear.default", module)}


def _adds(g: ReferenceGraph, module: str) -> dict[str, str]:
    return {n: "S0" for n in nodes(g, "aten.add.Tensor", module)}


def _split_input(g: ReferenceGraph, module: str) -> dict[str, str]:
    """The activation `module`'s linears read, batch-split: gathered by the linear itself (the
    search may otherwise gather earlier, before a norm's last elementwise op)."""
    return {g.node(n).inputs[0]: "S0" for n in nodes(g, "aten.linear.default", module)}


def _row_parallel(g: ReferenceGraph, module: str) -> dict[str, str]:
    """`module`'s linears Partial, and the clones (dropout with p = 0) of their outputs batch-split:
    the reduce-scatter then follows the linear itself, not a clone of its Partial."""
    rows = _linears(g, module, "P")
    return rows | {n.name: "S0" for n in g.calls if n.target == "aten.clone.default" and n.inputs[0] in rows}


def _mlp(first: str, second: str, blocks: str) -> Callable[[ReferenceGraph], dict[str, str]]:
    """Column-parallel `first`, row-parallel `second`, the residual adds of `blocks` batch-split."""
    return lambda g: _linears(g, first, "S2") | _row_parallel(g, second) | _adds(g, blocks)


def _ops(g: ReferenceGraph, target: str, layout: str) -> dict[str, str]:
    return {n: layout for n in nodes(g, target)}


def _convs(g: ReferenceGraph, layout: str) -> dict[str, str]:
    return _ops(g, "aten.convolution.default", layout)


FORCE: dict[str, Callable[[ReferenceGraph], dict[str, str]]] = {
    "gpt": _mlp("ffn.fc1", "ffn.fc2", "blocks"),
    "bert": _mlp("ffn.fc1", "ffn.fc2", "layers"),
    "vit": _mlp("ffn.fc1", "ffn.fc2", "blocks"),
    # the experts are einsums (not fusable): attention's q, k, v column-parallel, out row-parallel
    "moe": lambda g: (_linears(g, "attn.query", "S2") | _linears(g, "attn.key", "S2")
                      | _linears(g, "attn.value", "S2") | _row_parallel(g, "attn.out") | _adds(g, "blocks")),
    # data-parallel convolutions, then the classifier: fc1 column-, fc2 row-parallel, fc3 batch-split
    "vgg": lambda g: (_convs(g, "S0") | _ops(g, "aten.view.default", "S0") | _linears(g, "fc1", "S1")
                      | _row_parallel(g, "fc2") | _linears(g, "fc3", "S0")),
    # one linear (the head): gathered into a class-parallel fc (ag_matmul), or reading the
    # channel-parallel last block and reduce-scattered by batch (matmul_rs)
    "resnet/ag": lambda g: _convs(g, "S0") | _ops(g, "aten.view.default", "S0") | _linears(g, "fc", "S1"),
    "resnet/rs": lambda g: (_convs(g, "S0") | {"convolution_3": "S1", "convolution_5": "S1", "view": "S1"}
                            | _row_parallel(g, "fc")),
    "torch:transformer-encoder": _mlp("linear1", "linear2", "body"),
    "torch:transformer": _mlp("linear1", "linear2", "body"),
    "torch:mha": lambda g: _linears(g, "mlp.0", "S2") | _row_parallel(g, "mlp.2") | _adds(g, ""),
    # the recurrent body is batch-parallel; its one linear, the LM head, vocabulary-parallel
    "torch:lstm": lambda g: _linears(g, "head", "S2") | _split_input(g, "head"),
    "torch:gru": lambda g: _linears(g, "head", "S2") | _split_input(g, "head"),
    # an MLP on [B, C] features: body.0 column-parallel reads the input (sliced, never gathered),
    # body.3 row-parallel feeds BatchNorm1d's batch statistics (its Partial all-reduced: no
    # reduce-scatter to fuse), the head class-parallel on the gathered batch (ag_matmul)
    "torch:batchnorm1d": lambda g: (_linears(g, "body.0", "S1") | _row_parallel(g, "body.3")
                                    | _linears(g, "head", "S1") | _split_input(g, "head")),
    "hf-bert": _mlp("intermediate.dense", "output.dense", "encoder.layer"),
    # SwiGLU: gate_proj reads the gathered x (ag_matmul), up_proj the same x_full at no cost
    "hf:llama": lambda g: (_linears(g, "mlp.gate_proj", "S2") | _linears(g, "mlp.up_proj", "S2")
                           | _row_parallel(g, "mlp.down_proj") | _adds(g, "model.model.layers")
                           | _split_input(g, "mlp.gate_proj")),
}

# Every fused kind each model's forced plan must hold.
KINDS = {m: set(FUSED) for m in FORCE} | {"resnet/ag": {"ag_matmul"}, "resnet/rs": {"matmul_rs"},
                                          "torch:lstm": {"ag_matmul"}, "torch:gru": {"ag_matmul"},
                                          "torch:batchnorm1d": {"ag_matmul"}}

# Models that compute in float32 inside a float64 run (HuggingFace's RMSNorm and causal-LM loss
# upcast with .float()): any batch-split plan differs from one device by ~1e-7 there, fused or
# not, so the fused plan is compared with its unfused twin (planner.without_fusion).
FLOAT32_INSIDE = {"hf:llama"}

SHAPES: dict[int, dict[str, list[float]]] = {
    2: {"even": [0.5, 0.5], "uneven": [0.55, 0.45], "zero": [0.0, 1.0]},
    3: {"even": [1 / 3] * 3, "uneven": [0.5, 0.3, 0.2], "zero": [0.5, 0.0, 0.5]},
    4: {"even": [0.25] * 4, "uneven": [0.4, 0.3, 0.2, 0.1], "zero": [0.5, 0.3, 0.2, 0.0]},
}


def ref(case: str) -> str:
    """The model of a case ("resnet/rs": resnet's tiny preset), batch 12, float64."""
    model = case.split("/")[0]
    name = model if ":" in model else f"{model}:tiny"
    return f"{name},batch_size=12,dtype=float64"


def fused_plan(model: str, ratios: list[float], variants: dict | None = None) -> Plan:
    from hetsynth import capture_model
    from hetsynth.planner.problem import Restrictions

    r = ref(model)
    restrict = Restrictions(force=FORCE[model](capture_model(r)), two_level=False, force_fusion=True,
                            **({"variants": variants} if variants else {}))
    return make(r, ratios, restrict)


def trained(pools, plan: Plan) -> tuple[list[float], dict]:
    """(global losses, reassembled parameters) after CONFIG's steps of `plan` on a pool."""
    from hetsynth.runtime.rank_state import assemble

    results = pools.get(plan.cluster.num_devices).run(train_worker, plan, CONFIG, timeout_s=600)
    return results[0][0], assemble(plan, [r[1] for r in results])


def single_device(plan: Plan) -> tuple[list[float], dict]:
    from hetsynth.instruction_set.models import parse_model_ref
    from hetsynth.runtime.train import reference_training

    spec = parse_model_ref(plan.model.ref)
    return reference_training(spec, spec.batch_size, CONFIG)


def errors(got: tuple[list[float], dict], want: tuple[list[float], dict]) -> tuple[float, float]:
    """(largest relative loss difference over the steps, largest parameter difference)."""
    loss = max(abs(g - w) / abs(w) for g, w in zip(got[0], want[0]))
    param = max((float((v - want[1][k]).abs().max()) if v.numel() else 0.0) for k, v in got[1].items())
    return loss, param


def chunk_lengths(plan: Plan) -> set[tuple[int, ...]]:
    """The per-rank lengths of every fused instruction's chunks (the ring's pieces)."""
    out = set()
    for ins in plan.instructions:
        if ins.kind in FUSED:
            tensor, split = ((plan.graph.node(ins.node).inputs[0], ins.src) if ins.kind == "ag_matmul"
                             else (ins.tensor, ins.layout))
            out.add(tuple(plan.shards[tensor][split][split.axis(ins.axis).dim]))
    return out


def check_fused(pools, model: str, world: int, shape: str, variants: dict | None = None) -> tuple[float, float]:
    """The case's plan holds its fused kinds (in `variants`) and trains like one device."""
    plan = fused_plan(model, SHAPES[world][shape], variants)
    fused = [i for i in plan.instructions if i.kind in FUSED]
    assert {i.kind for i in fused} >= KINDS[model], [i.describe() for i in plan.instructions]
    if variants:
        assert all(i.variant in variants[i.kind] for i in fused), [i.describe() for i in fused]
    from hetsynth.planner.planner import without_fusion

    got = trained(pools, plan)
    loss, param = errors(got, trained(pools, without_fusion(plan)) if model in FLOAT32_INSIDE else single_device(plan))
    print(f"{model} world={world} {shape} chunks {sorted(chunk_lengths(plan))} "
          f"{sorted({(i.kind, i.variant) for i in fused})}: "
          f"loss {loss:.2e} params {param:.2e}")
    assert loss <= 1e-9 and param <= 1e-8, (loss, param)
    return loss, param


VARIANTS = {"ring": {"ag_matmul": ("ring",), "matmul_rs": ("ring",)},
            "sliced": {"ag_matmul": ("sliced2",), "matmul_rs": ("sliced4",)},
            "sliced-swapped": {"ag_matmul": ("sliced4",), "matmul_rs": ("sliced2",)}}

# every model at every world size and shard shape with the ring, and with k-slicing where a
# shard is empty (k > a chunk's length: empty slices on some ranks)
MATRIX = ([(m, w, s, "ring") for m in FORCE for w in SHAPES for s in SHAPES[w]]
          + [(m, w, "zero", "sliced" if w == 3 else "sliced-swapped") for m in FORCE for w in (3, 4)])

# the default suite's share (~30 s): every world size and shard shape, every variant, BERT's
# ag_matmul, a 2-d linear (vgg), torch's TransformerEncoder, attention's q/k/v reading x_full (moe)
SUBSET = [("bert", 3, "zero", "sliced"), ("vgg", 4, "uneven", "ring"),
          ("torch:transformer-encoder", 2, "zero", "sliced-swapped"), ("moe", 4, "even", "ring")]


@pytest.mark.parametrize("model,world,shape,variant", SUBSET)
def test_fused_plans_train_like_one_device(pools, model: str, world: int, shape: str, variant: str) -> None:
    check_fused(pools, model, world, shape, VARIANTS[variant])


@pytest.mark.skipif(not os.environ.get("HETSYNTH_FUSED_MATRIX"), reason="the whole matrix: HETSYNTH_FUSED_MATRIX=1")
@pytest.mark.parametrize("model,world,shape,variant", MATRIX)
def test_matrix(pools, model: str, world: int, shape: str, variant: str) -> None:
    check_fused(pools, model, world, shape, VARIANTS[variant])


def test_hf_gpt2_blocks_have_no_fusable_pair() -> None:
    """GPT-2's Conv1D is `addmm(b, x, W)` (planner.fusions.FUSABLE is `linear`) and its output is
    viewed back to 3-d before the reduce-scatter: in a sequence-parallel tensor-parallel plan the
    all-gathers feed addmm and the reduce-scatters follow views, and nothing is fused."""
    from hetsynth import capture_model
    from hetsynth.planner.problem import Restrictions

    r = ref("hf-gpt2")
    g = capture_model(r)
    mm = lambda module, layout: {n: layout for n in nodes(g, "aten.addmm.default", module)}
    force = mm("mlp.c_fc", "S1") | mm("mlp.c_proj", "P") | _adds(g, "model.transformer")
    plan = make(r, SHAPES[3]["uneven"], Restrictions(force=force, two_level=False, force_fusion=True))
    gathered = {i.tensor for i in plan.instructions if i.kind == "all_gather"}
    assert any(n.target == "aten.addmm.default" and set(n.inputs) & gathered for n in plan.graph.calls)
    scattered = {i.tensor for i in plan.instructions if i.kind == "reduce_scatter"}
    assert {plan.graph.node(t).inputs[0] for t in scattered} & set(mm("mlp.c_proj", "P"))
    assert not [i.describe() for i in plan.instructions if i.kind in FUSED]
