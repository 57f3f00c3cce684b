"""A user's training script, written only against the public calls (hetsynth.parallelize,
hetsynth.data.loader, torch.optim.AdamW with two param groups, LambdaLR, two accumulation
micro-steps, clip_grad_norm_, global_loss, state_dict), launched with `hetsynth launch` on the
local emulated cluster (4 ranks, uneven ratios; plain local processes without root), trains
an HF GPT-2 with tied embeddings in float64 to the losses (1e-9) and parameters (1e-8) of the
same loop on one device with a plain DataLoader, under the planner's plan (made from the module
with hetsynth.plan), a tensor-parallel plan and a ZeRO-2 plan. A script that raises on one rank
is named."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hetsynth
from hetsynth.api import _forced_zero as forced_zero
from test_parity import CLUSTER

# multi-process or seconds long: make test runs them, make test-fast does not
pytestmark = pytest.mark.slow

pytest.importorskip("transformers")

MODEL = textwrap.dedent('''
    import torch, torch.nn.functional as F, transformers
    from torch import nn
    VOCAB, SEQ = 48, 8

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
            config._attn_implementation = "eager"
            self.hf = transformers.GPT2LMHeadModel(config)

        def forward(self, ids, labels):
            logits = self.hf(input_ids=ids).logits
            return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))

    def dataset():
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, VOCAB, (64, SEQ), generator=g)
        return torch.utils.data.TensorDataset(ids, ids.clone())

    def model():
        torch.manual_seed(0)
        return TinyLM().double()

    def train(module, batches, step_done):
        decay = [p for n, p in module.named_parameters() if p.dim() >= 2]
        rest = [p for n, p in module.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                lr=3e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
        losses, total = [], 0.0
        for i, batch in enumerate(batches):
            total += step_done(module, batch, i % 2 == 0)
            if i % 2 == 1:
                clip = getattr(module, "clip_grad_norm_", None)
                (clip or (lambda m: torch.nn.utils.clip_grad_norm_(module.parameters(), m)))(0.5)
                opt.step(); sched.step(); opt.zero_grad()
                losses.append(total)
                total = 0.0
        return losses
''')

SCRIPT = textwrap.dedent('''
    import json, os, sys, contextlib
    import torch
    import hetsynth, hetsynth.data
    from lm import model, dataset, train

    plan = hetsynth.load_plan(os.environ["HETSYNTH_PLAN"])
    if os.environ.get("FAIL_ON_RANK") == os.environ["RANK"]:
        raise ValueError("the data of rank " + os.environ["RANK"] + " is bad")
    pm = hetsynth.parallelize(model(), plan)

    def micro(module, batch, first):
        with module.no_sync() if first else contextlib.nullcontext():
            loss = module(*batch) / 2
            loss.backward()
        return module.global_loss(loss)

    losses = train(pm, hetsynth.data.loader(dataset(), plan, shuffle=True, seed=3), micro)
    state = pm.state_dict(rank0_only=True)
    if int(os.environ["RANK"]) == 0:
        torch.save({"losses": losses, "state": state}, sys.argv[1])
''')


def single_device(tmp_path: Path, batch: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    sys.path.insert(0, str(tmp_path))
    try:
        import lm  # the user's model file
    finally:
        sys.path.remove(str(tmp_path))
    data = torch.utils.data.DataLoader(lm.dataset(), batch_size=batch, shuffle=True,
                                       generator=torch.Generator().manual_seed(3), drop_last=True)
    module = lm.model()

    def micro(m, b, first):
        loss = m(*b) / 2
        loss.backward()
        return float(loss.detach())
    losses = lm.train(module, data, micro)
    sys.modules.pop("lm", None)
    return losses, module.state_dict()


def launch(tmp_path: Path, plan_path: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    out = tmp_path / "out.pt"
    import os

    return subprocess.run([sys.executable, "-m", "hetsynth", "launch", str(plan_path), str(tmp_path / "train.py"),
                           str(out)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path), **(env or {})})


RATIOS = [0.4, 0.3, 0.2, 0.1]


def other_plans(module, inputs, tmp: Path) -> None:
    """A tensor-parallel plan (Megatron's restrictions) and a ZeRO-2 plan of the same module."""
    from hetsynth.instruction_set.cluster import load_cluster
    from hetsynth.planner.baselines import megatron_restrictions
    from hetsynth.planner.capture import capture
    from hetsynth.planner.planner import DP_SEED, make_plan

    cluster = load_cluster(CLUSTER)
    graph = capture(module, inputs, model_ref="TinyLM")
    tp = make_plan(graph, cluster, ratios=RATIOS, progress=False, restrictions=megatron_restrictions(cluster),
                   with_baselines=False)
    assert any(i.kind == "param" and i.layout.is_shard for i in tp.instructions), "no sharded parameter"
    zero2 = forced_zero(make_plan(graph, cluster, ratios=RATIOS, progress=False, restrictions=DP_SEED,
                                            with_baselines=False), 2)
    hetsynth.save_plan(tp, tmp / "tp.json")
    hetsynth.save_plan(zero2, tmp / "zero2.json")


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("launch_train")
    (tmp / "lm.py").write_text(MODEL)
    (tmp / "train.py").write_text(SCRIPT)
    sys.path.insert(0, str(tmp))
    try:
        import lm
        ids, labels = lm.dataset()[0:8]
        plan = hetsynth.plan(lm.model(), [ids, labels], str(CLUSTER), ratios=RATIOS)
        other_plans(lm.model(), [ids, labels], tmp)
    finally:
        sys.path.remove(str(tmp))
        sys.modules.pop("lm", None)
    hetsynth.save_plan(plan, tmp / "plan.json")
    return tmp, tmp / "plan.json"


@pytest.mark.parametrize("which", ["plan", "tp", "zero2"])
def test_user_script_under_launch_matches_one_device(planned, which: str) -> None:
    tmp, _ = planned
    done = launch(tmp, tmp / f"{which}.json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = torch.load(tmp / "out.pt")
    want_losses, want = single_device(tmp, 8)
    assert len(got["losses"]) == len(want_losses) == 4
    for step, (a, b) in enumerate(zip(got["losses"], want_losses)):
        assert abs(a - b) <= 1e-9 * abs(b), f"step {step}: {a} != {b}"
    assert set(got["state"]) == set(want)
    for name, value in want.items():
        assert float((got["state"][name] - value).abs().max()) <= 1e-8, name


def test_a_script_that_raises_on_one_rank_is_named(planned) -> None:
    tmp, plan_path = planned
    done = launch(tmp, plan_path, {"FAIL_ON_RANK": "2"})
    text = done.stdout + done.stderr
    assert done.returncode == 1, text[-3000:]
    assert "rank 2" in text and "ValueError: the data of rank 2 is bad" in text, text[-3000:]
