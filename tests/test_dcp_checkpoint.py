"""Checkpoints through torch.distributed.checkpoint (hetsynth.checkpoint, runtime.dcp) travel
between plans: 2 AdamW steps under a data-parallel plan on 2 ranks, saved, loaded under a
plan on 4 ranks (ZeRO-2 at other ratios, the planner's plan at those ratios, a 2-stage
pipeline) before the optimizer's first step, 2 more steps: the parameters equal 4
uninterrupted single-device steps within 1e-8 (float64), and so does the checkpoint the other
plan saves. Each rank writes only the chunks it owns; the export loads into the plain module
with strict=True (an HF GPT-2 with its tied head too, and save_pretrained round-trips); a
checkpoint of another model is refused before anything is read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetsynth.checkpoint import export, export_state_dict
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.instruction_set.plan import Plan
from hetsynth.planner.planner import DP_SEED
from hetsynth.api import _forced_zero as forced_zero
from test_parity import make

REF = "gpt:tiny,dtype=float64"
LR = 1e-2


def _optimizer(params) -> torch.optim.Optimizer:
    named = list(params)
    decay = [p for _, p in named if p.dim() >= 2]
    rest = [p for _, p in named if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=LR)


def _steps(pm, opt, spec, rows, first: int, count: int) -> None:
    batch_size = spec.batch_size
    for step in range(first, first + count):
        batch = spec.make_batch(range(step * batch_size, (step + 1) * batch_size), seed=0)
        mine = [x[r] for x, r in zip(batch, rows)]
        if hasattr(pm, "train_step"):  # hetsynth's modules, SPMD or pipeline
            pm.train_step(*mine)
        else:
            pm(*mine).backward()
        opt.step()
        opt.zero_grad()


def _worker(rank: int, world: int, plan: Plan, path: str, load: bool, first: int, count: int,
            out: str | None = None) -> tuple:
    """Build the plan's module (from other values when it loads), load `path` if `load`,
    train `count` steps from `first`, save to `out`."""
    assert plan.model.batch_size == parse_model_ref(plan.model.ref).batch_size
    import hetsynth.checkpoint as ckpt
    from hetsynth import parallelize
    from hetsynth.runtime.input_rows import input_rows

    spec = parse_model_ref(plan.model.ref)
    torch.manual_seed(1 if load else 0)  # a loaded run starts from other values
    pm = parallelize(spec.build("cpu"), plan, check_graph=False)
    opt = _optimizer(pm.named_parameters())
    step = ckpt.load(path, pm, opt) if load else 0
    _steps(pm, opt, spec, input_rows(plan, rank), first, count)
    owned = {f: p.offsets for f, p in pm.local_pieces().items() if p.owner and p.tensor.numel()}
    if out is not None:
        ckpt.save(out, pm, opt, step=first + count, extra={"note": f"{first + count} steps"})
    return step, owned, pm.state_dict(rank0_only=True)


def _reference(steps: int) -> dict[str, torch.Tensor]:
    spec = parse_model_ref(REF)
    torch.manual_seed(0)
    model = spec.build("cpu")
    _steps(model, _optimizer(model.named_parameters()), spec, [slice(None)] * 8, 0, steps)
    return model.state_dict()


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory) -> tuple[Path, list]:
    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    plan = make(REF, [0.6, 0.4], DP_SEED)
    results = pools.get(2).run(_worker, plan, "", False, 0, 2, str(path), timeout_s=300)
    return path, results


def _close(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        err = float((got[key] - value).abs().max()) if value.numel() else 0.0
        assert err <= 1e-8, f"{key}: max difference {err}"


def _plan_b(kind: str) -> Plan:
    """4 ranks: ZeRO-2 at ratios 0.4/0.3/0.2/0.1, the planner's choice at those ratios, or a
    pipeline of 2 stages (0.7/0.3 | 0.5/0.5, GPT's embedding tied across them)."""
    from hetsynth.instruction_set.schedule import Schedule
    from test_pipeline_parity import pipeline_plans

    if kind == "pipeline":
        return pipeline_plans(REF, 2, 3, (Schedule.ONE_F_ONE_B,))[0]
    plan = make(REF, [0.4, 0.3, 0.2, 0.1])
    return forced_zero(plan, 2) if kind == "zero2" else plan


@pytest.mark.parametrize("kind", ["zero2", "planner", "pipeline"])
def test_resume_under_another_plan(pools, saved, kind, tmp_path) -> None:
    """Loaded under the other plan before the optimizer's first step, trained on, saved from
    the other plan's pieces (ZeRO-2 rows, or the planner's shards): exact both times."""
    from hetsynth.checkpoint import load_extra

    path, _ = saved
    plan = _plan_b(kind)
    results = pools.get(4).run(_worker, plan, str(path), True, 2, 2, str(tmp_path / "b"), timeout_s=300)
    assert [r[0] for r in results] == [2] * 4
    want = _reference(4)
    _close(results[0][2], want)
    _close(export_state_dict(tmp_path / "b"), want)
    assert load_extra(tmp_path / "b") == {"note": "4 steps"}


def test_each_rank_writes_its_pieces(saved) -> None:
    import torch.distributed.checkpoint as dcp

    path, results = saved
    metadata = dcp.FileSystemReader(path).read_metadata()
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("model."):
            fqn = index.fqn[len("model."):]
            writer = int(info.relative_path.split("_")[2])
            assert tuple(index.offset) == results[writer][1][fqn], (fqn, writer)
    # data parallel: rank 0 owns every parameter; rank 1 writes only its share of the
    # deduplicated plain tensors (buffers, AdamW's step), no piece
    ones = {i.fqn for i, info in metadata.storage_data.items() if info.relative_path.startswith("__1_")}
    assert ones and not {f for f in ones if f.startswith("model.") or f.endswith(("exp_avg", "exp_avg_sq"))}
    copy = 8 * sum(v.numel() for v in _reference(0).values())  # the float64 parameters
    assert (path / "__1_0.distcp").stat().st_size < 0.5 * copy  # the whole state: 3 * copy


def test_export_loads_strict(saved, tmp_path) -> None:
    from safetensors.torch import load_file

    path, results = saved
    model = parse_model_ref(REF).build("cpu")
    for out in (tmp_path / "model.safetensors", tmp_path / "model.pt"):
        export(path, out)
        state = load_file(out) if out.suffix == ".safetensors" else torch.load(out, weights_only=True)
        model.load_state_dict(state, strict=True)
        _close(model.state_dict(), results[0][2])


def _save_worker(rank: int, world: int, plan: Plan, path: str) -> dict:
    import hetsynth.checkpoint as ckpt
    from hetsynth import parallelize

    torch.manual_seed(0)
    pm = parallelize(parse_model_ref(plan.model.ref).build("cpu"), plan)
    ckpt.save(path, pm, step=1)
    ckpt.save(path, pm, step=2)  # replaces the first
    return pm.state_dict()


def test_hf_export_with_tied_weights(pools, tmp_path) -> None:
    """An HF GPT-2 (lm_head tied to the token embedding) saved under a plan on 2 ranks: the
    export loads strict=True, keeps the tie's two names, and save_pretrained round-trips."""
    from safetensors.torch import load_file

    from hetsynth.cli import main
    from hetsynth.runtime.dcp import read_record

    ref = "hf-gpt2:tiny,dtype=float64"
    want = pools.get(2).run(_save_worker, make(ref, [0.7, 0.3]), str(tmp_path / "ckpt"), timeout_s=300)[0]
    assert read_record(tmp_path / "ckpt")["step"] == 2 and [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert main(["checkpoint", "export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "m.safetensors")]) == 0
    model = parse_model_ref(ref).build("cpu")
    model.load_state_dict(load_file(tmp_path / "m.safetensors"), strict=True)
    assert model.model.lm_head.weight is model.model.transformer.wte.weight
    _close(model.state_dict(), want)
    model.model.save_pretrained(tmp_path / "hf")
    again = type(model.model).from_pretrained(tmp_path / "hf", torch_dtype=torch.float64)
    _close({f"model.{k}": v for k, v in again.state_dict().items()}, want)


def _load_worker(rank: int, world: int, plan: Plan, path: str) -> dict:
    import hetsynth.checkpoint as ckpt
    from hetsynth import parallelize

    torch.manual_seed(1)
    pm = parallelize(parse_model_ref(plan.model.ref).build("cpu"), plan, check_graph=False)
    ckpt.load(path, pm)
    return pm.state_dict(rank0_only=True)


def test_load_without_optimizer_under_zero(pools, saved) -> None:
    """Only the model: ZeRO-2's rows are read and gathered into the whole parameters."""
    path, results = saved
    got = pools.get(4).run(_load_worker, _plan_b("zero2"), str(path), timeout_s=300)[0]
    _close(got, results[0][2])


def test_export_refuses_to_overwrite_the_checkpoint(saved, capsys) -> None:
    from hetsynth.cli import main

    path, _ = saved
    assert main(["checkpoint", "export", str(path), "-o", str(path / "__0_0.distcp")]) == 2
    assert "would overwrite the input CKPT file '__0_0.distcp'" in capsys.readouterr().err


def test_another_model_refused(pools, saved) -> None:
    from hetsynth.runtime.pool import PoolError

    path, _ = saved
    plan = make("bert:tiny", [0.5, 0.5], DP_SEED)
    with pytest.raises(PoolError, match="is of another model: parameter '.*' "):
        pools.get(2).run(_worker, plan, str(path), True, 0, 0, timeout_s=120)
