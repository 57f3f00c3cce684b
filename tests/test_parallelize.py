"""hetsynth.parallelize: the user's own loop over the plan's program (runtime.parallel).

A user loop (AdamW with two param groups, a LambdaLR schedule, two accumulation micro-steps
per optimizer step, the first under no_sync, clip_grad_norm_, global_loss, state_dict) on
every rank of a 4-rank pool with uneven ratios trains in float64 to the same losses (1e-9)
and parameters and buffers (1e-8) as the same loop on one device with the plain module:
for an HF GPT-2 causal LM with tied embeddings (a plan made with hetsynth.plan from the
module), under the planner's own plan, a tensor-parallel plan and a ZeRO-2 plan, and for a
ResNet (BatchNorm buffers) and BERT under ZeRO-3, and for the GPT-2 LM with dropout (one
device's draws). Bad input is refused before any step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hetsynth
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.planner.baselines import megatron_restrictions
from hetsynth.planner.capture import capture
from hetsynth.planner.planner import DP_SEED, make_plan
from hetsynth.api import _forced_zero as forced_zero
from test_parity import CLUSTER, make

transformers = pytest.importorskip("transformers")

STEPS, MICRO, BATCH, SEQ, VOCAB = 3, 2, 8, 8, 48
RATIOS = [0.4, 0.3, 0.2, 0.1]


class TinyLM(nn.Module):
    """HF GPT-2 (tied input and output embeddings) with the loss computed here: HF's own loss
    upcasts the logits with .float(), which would round a float64 run to float32."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                         resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False)
        config._attn_implementation = "eager"
        self.hf = transformers.GPT2LMHeadModel(config)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.hf(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


def build_lm() -> nn.Module:
    torch.manual_seed(0)
    return TinyLM().double()


def lm_batches(count: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append([ids, ids.clone()])
    return out


def optimizer_for(named: list[tuple[str, nn.Parameter]]) -> tuple[torch.optim.Optimizer, object]:
    decay = [p for n, p in named if p.dim() >= 2]
    rest = [p for n, p in named if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=3e-3)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))


def user_loop(model, batches, select, distributed: bool) -> list[float]:
    """The loop a user writes; `select` picks a rank's rows of a global batch."""
    opt, sched = optimizer_for(list(model.named_parameters()))
    losses = []
    for step in range(STEPS):
        total = 0.0
        for k in range(MICRO):
            inputs = select(batches[step * MICRO + k])
            sync = model.no_sync() if distributed and k < MICRO - 1 else _nothing()
            with sync:
                loss = model(*inputs) / MICRO
                loss.backward()
            total += model.global_loss(loss) if distributed else float(loss.detach())
        (model.clip_grad_norm_ if distributed else lambda m: torch.nn.utils.clip_grad_norm_(model.parameters(), m))(0.5)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return losses


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def lm_worker(rank: int, world: int, plan, build, batches):
    from hetsynth.runtime.input_rows import input_rows

    pm = hetsynth.parallelize(build(), plan)
    rows = input_rows(plan, rank)
    losses = user_loop(pm, batches, lambda batch: [x[r] for x, r in zip(batch, rows)], True)
    with torch.no_grad():  # an evaluation pass: no gradient, no sync
        pm(*[x[r] for x, r in zip(batches[0], rows)])
    return losses, pm.state_dict(rank0_only=True)


def single_device(build, batches) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build()
    losses = user_loop(model, batches, lambda batch: batch, False)
    with torch.no_grad():
        model(*batches[0])
    return losses, model.state_dict()


def check(pools, plan, build, batches) -> None:
    got_losses, got = pools.get(len(plan.sharding_ratios)).run(lm_worker, plan, build, batches, timeout_s=600)[0]
    want_losses, want = single_device(build, batches)
    for step, (a, b) in enumerate(zip(got_losses, want_losses)):
        assert abs(a - b) <= 1e-9 * abs(b), f"step {step}: loss {a} != {b}"
    assert set(got) == set(want), set(got) ^ set(want)
    for name, value in want.items():
        err = float((got[name].double() - value.double()).abs().max()) if value.numel() else 0.0
        assert err <= 1e-8, f"{name}: max difference {err}"


@pytest.fixture(scope="module")
def lm_plan():
    """The planner's plan of the HF LM, made from the module (the Python API)."""
    cluster = load_cluster(CLUSTER)
    return hetsynth.plan(build_lm(), lm_batches(1)[0], cluster, ratios=RATIOS)


def test_hf_lm_under_the_planners_plan(pools, lm_plan) -> None:
    check(pools, lm_plan, build_lm, lm_batches(STEPS * MICRO))


def test_hf_lm_under_a_tensor_parallel_plan(pools) -> None:
    cluster = load_cluster(CLUSTER)
    graph = capture(build_lm(), lm_batches(1)[0], model_ref="TinyLM")
    plan = make_plan(graph, cluster, ratios=RATIOS, progress=False, restrictions=megatron_restrictions(cluster),
                     with_baselines=False)
    assert any(i.kind == "param" and i.layout.is_shard for i in plan.instructions), "no sharded parameter"
    check(pools, plan, build_lm, lm_batches(STEPS * MICRO))


def test_hf_lm_under_zero2(pools) -> None:
    cluster = load_cluster(CLUSTER)
    graph = capture(build_lm(), lm_batches(1)[0], model_ref="TinyLM")
    plan = forced_zero(make_plan(graph, cluster, ratios=RATIOS, progress=False, restrictions=DP_SEED,
                                           with_baselines=False), 2)
    check(pools, plan, build_lm, lm_batches(STEPS * MICRO))


def build_dropout_lm() -> nn.Module:
    """The LM with dropout 0.1 everywhere; on a rank, its generator then advanced by a number
    of draws that differs between ranks (a user's rank-dependent draws before parallelize)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = TinyLM(dropout=0.1).double()
    if dist.is_initialized():
        torch.rand(3 * dist.get_rank())
    return model


def test_hf_lm_with_dropout_draws_one_devices_values(pools) -> None:
    """HF GPT-2 with embedding, attention and residual dropout, in the user's loop at uneven
    ratios: parallelize sets every rank's generator to rank 0's, each rank draws every random
    op whole and keeps its part, so the run is the same loop on one device (whose generator is
    rank 0's), float64 within 1e-9."""
    cluster = load_cluster(CLUSTER)
    plan = hetsynth.plan(build_dropout_lm(), lm_batches(1)[0], cluster, ratios=RATIOS)
    assert any(n.target == "aten.native_dropout.default" for n in plan.graph.calls)
    check(pools, plan, build_dropout_lm, lm_batches(STEPS * MICRO))


def zoo_build(ref: str):
    from hetsynth.instruction_set.models import parse_model_ref

    def build() -> nn.Module:
        torch.manual_seed(0)
        return parse_model_ref(ref).build("cpu")
    return build


@pytest.mark.parametrize("ref,zero", [("resnet:tiny,dtype=float64", None), ("bert:tiny,dtype=float64", 3)])
def test_zoo_models(pools, ref: str, zero: int | None) -> None:
    from hetsynth.instruction_set.models import parse_model_ref

    spec = parse_model_ref(ref)
    plan = make(ref, [0.5, 0.3, 0.2, 0.0], DP_SEED if zero else None)  # a rank of no rows
    plan = forced_zero(plan, zero) if zero else plan
    B = spec.batch_size
    batches = [list(spec.make_batch(range(i * B, (i + 1) * B), seed=0)) for i in range(STEPS * MICRO)]
    check(pools, plan, _ZooBuild(ref), batches)


class _ZooBuild:
    """A picklable zoo model factory (the pool sends it to the ranks)."""

    def __init__(self, ref: str) -> None:
        self.ref = ref

    def __call__(self) -> nn.Module:
        return zoo_build(self.ref)()


# -- bad input -------------------------------------------------------------------------------------

def refusal_worker(rank: int, world: int, plan, case: str):
    model = build_lm()
    if case == "other module":
        model.hf.transformer.h[0].mlp.act = nn.Tanh()  # same parameters, another forward
    elif case == "other weights" and rank == 1:
        with torch.no_grad():
            model.hf.transformer.h[1].attn.c_attn.weight[0, 0] += 1.0
    elif case == "other shapes":
        model.hf.transformer.wpe = nn.Embedding(SEQ + 1, 32).double()
    try:
        pm = hetsynth.parallelize(model, plan)
    except ValueError as err:
        return str(err)
    from hetsynth.runtime.input_rows import input_rows

    rows = input_rows(plan, rank)
    ids = lm_batches(1)[0][0]
    try:
        pm(ids[rows[0]][:, :-1], ids[rows[1]])  # the wrong sequence length
    except ValueError as err:
        return str(err)
    return "accepted"


@pytest.mark.parametrize("case,message", [
    ("other module", "is not the one the plan was made for"),
    ("other weights", "ranks passed different values for 'hf.transformer.h.1.attn.c_attn.weight'"),
    ("other shapes", "'hf.transformer.wpe.weight' is (9, 32) float64 here, (8, 32) float64 in the plan"),
    ("wrong batch", "this rank's rows of the plan's (8, 8) are"),
])
def test_refusals(pools, lm_plan, case: str, message: str) -> None:
    results = pools.get(4).run(refusal_worker, lm_plan, case, timeout_s=300)
    for rank, text in enumerate(results):
        assert message in text, f"rank {rank}: {text}"
