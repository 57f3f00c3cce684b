"""Model families from their configs through inspect -> plan -> run --check.

    python bench/families.py                 # every family below
    python bench/families.py hf:t5 torch:lstm   # these rows again, the others kept

Each model is built from a small config (nothing downloaded), captured without the replicated
fallback (when that fails, the unsupported ops are recorded and it is captured with it),
planned for the first 4 devices of configs/clusters/local-emulated.toml (a 2 x 2 mesh; the
ratio LP picks uneven ratios for its fast and slow devices), then checked as `hetsynth run
--check` does (runtime.check on a pool of 4 gloo ranks, 5 AdamW steps): the float32 plan
against single-device float32 training (information) and its float64 twin against float64
training, which decides (1e-9 relative loss, 1e-8 parameters and buffers). Prints a table
(also as Markdown) and writes bench/results/families.json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, ROOT, print_tables, write_json  # noqa: E402

HF = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt_neox", "opt", "bloom",
      "falcon", "gptj", "gpt2", "t5", "bart", "bert", "roberta", "distilbert", "albert", "electra",
      "deberta-v2", "vit", "swin", "convnext", "resnet", "mobilenet_v2"]
TORCH = ["transformer-encoder", "transformer", "mha", "lstm", "gru", "batchnorm1d", "groupnorm",
         "instancenorm", "depthwise", "unet"]
ZOO = ["gpt:tiny", "bert:tiny", "vit:tiny", "vgg:tiny", "moe:tiny", "resnet:tiny"]
FAMILIES = [f"hf:{m}" for m in HF] + [f"torch:{f}" for f in TORCH] + ZOO
STEPS = 5


def capture(ref: str) -> tuple[Any, dict]:
    import hetsynth
    from hetsynth.planner.capture import UnsupportedOpsError

    start = time.perf_counter()
    try:
        graph = hetsynth.capture_model(ref)
        unsupported: list[str] = []
    except UnsupportedOpsError as err:
        unsupported = [op.target for op in err.report]
        graph = hetsynth.capture_model(ref, allow_replicate_fallback=True)
    return graph, {"capture_s": time.perf_counter() - start, "ops": len(graph.calls),
                   "fallback_ops": unsupported}


def plan(graph: Any) -> tuple[Any, dict]:
    from hetsynth.instruction_set.cluster import load_cluster
    from hetsynth.planner.planner import make_plan

    cluster = load_cluster(ROOT / "configs" / "clusters" / "local-emulated.toml").first(4)
    start = time.perf_counter()
    result = make_plan(graph, cluster, progress=False, with_baselines=False)
    split = sum(1 for i in result.instructions if i.kind == "compute" and i.layout.is_shard)
    computes = sum(1 for i in result.instructions if i.kind == "compute")
    return result, {"plan_s": time.perf_counter() - start, "ratios": [round(r, 3) for r in result.sharding_ratios],
                    "predicted_ms": result.predicted.step_time_s * 1e3, "split_ops": f"{split}/{computes}"}


def check(pools: dict, result: Any) -> dict:
    from hetsynth.runtime.check import check_on_pool
    from hetsynth.runtime.pool import RankPool
    from hetsynth.runtime.config import TrainConfig

    if pools.get("pool") is None or pools["pool"].broken:
        pools["pool"] = RankPool(4, timeout_s=300)
    comparisons = check_on_pool(pools["pool"], result, TrainConfig(steps=STEPS, lr=1e-3))
    return {c.dtype: {"ok": c.ok, "loss_rel": c.loss_rel, "worst": c.worst, "worst_diff": c.worst_diff}
            for c in comparisons}


def one(ref: str, pools: dict) -> dict:
    row: dict[str, Any] = {"family": ref}
    try:
        graph, facts = capture(ref)
        row.update(facts)
        result, facts = plan(graph)
        row.update(facts)
        row["check"] = check(pools, result)
    except Exception as err:  # a failing family is a result of this benchmark
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    return row


def table_row(r: dict) -> list[Any]:
    c64, c32 = (r.get("check") or {}).get("float64", {}), (r.get("check") or {}).get("float32", {})
    result = "OK" if c64.get("ok") else ("FAILED" if c64 else r.get("error", "")[:60])
    fmt = lambda v: f"{v:.1e}" if isinstance(v, float) else "-"
    return [r["family"], f"{r.get('capture_s', 0):.1f}", r.get("ops", "-"),
            ", ".join(o.removeprefix("aten.") for o in r.get("fallback_ops", [])) or "-",
            f"{r['predicted_ms']:.1f} ms, {r['split_ops']} split" if "predicted_ms" in r else "-",
            result, fmt(c64.get("loss_rel")), fmt(c64.get("worst_diff")), fmt(c32.get("loss_rel")),
            fmt(c32.get("worst_diff"))]


def main(refs: list[str]) -> None:
    import torch

    torch.set_num_threads(1)
    pools: dict = {}
    rows = []
    try:
        for ref in refs:
            rows.append(one(ref, pools))
            print(" ".join(str(c) for c in table_row(rows[-1])), flush=True)
    finally:
        if pools.get("pool") is not None:
            pools["pool"].close()
    header = ["family", "capture s", "ops", "fallback ops", "plan (predicted step, ops split)", "check (float64)",
              "loss rel. f64", "max param/buffer f64", "loss rel. f32", "max param/buffer f32"]
    rows = _merged(rows)
    print_tables([table_row(r) for r in rows], header)
    write_json("families.json", {"steps": STEPS, "cluster": "local-emulated (first 4 devices)", "rows": rows})


def _merged(rows: list[dict]) -> list[dict]:
    """A run of some families replaces their rows in the last results, keeping the others."""
    import json

    path = RESULTS / "families.json"
    if not path.exists():
        return rows
    new = {r["family"]: r for r in rows}
    old = [r for r in json.loads(path.read_text())["rows"] if r["family"] not in new]
    order = {ref: i for i, ref in enumerate(FAMILIES)}
    return sorted(old + rows, key=lambda r: order.get(r["family"], len(order)))


if __name__ == "__main__":
    main(sys.argv[1:] or FAMILIES)
