"""Collective variants measured against the cost model: which variant is fastest for uneven
shards, and does the cost model pick it?

    python bench/collectives.py [--envs emulated local] [--quick]

For skews from even to 90/10 (the first rank's share; the other ranks split the rest evenly)
and message sizes from 64 KiB to 64 MiB, every variant of all-gather (padded, grouped, ring),
reduce-scatter (padded, grouped, ring), all-reduce and all-to-all is timed on all 4 ranks of
- `emulated`: configs/clusters/local-emulated.toml on this machine (two nodes, 200 Mbit/s
  between them, CPU quotas; needs root), and
- `local`: 4 plain local processes (one node, loopback).
Each environment is profiled first (`hetsynth profile`) and the cost model (cost_models.comm)
predicts every case from that calibration. For every (kind, size, skew) with several
variants, the variant the model picks is compared with the measured fastest; a pick counts
as right when its measured time is within 10% of the fastest. Prints the tables, writes
bench/results/collectives.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from common import RESULTS, ROOT, markdown_table, print_table, write_json

sys.path.insert(0, str(ROOT))

SIZES = [64 * 2**10, 2**20, 16 * 2**20, 64 * 2**20]
SKEWS = [0.0, 0.4, 0.6, 0.75, 0.9]   # 0 = even (25% each); else the first rank's share


def environment(name: str, workdir: Path) -> Path:
    """The spec of an environment, profiled."""
    from hetsynth.instruction_set.cluster import dump_cluster_toml, load_cluster

    base = load_cluster(ROOT / "configs" / "clusters" / "local-emulated.toml")
    if name == "local":
        raw = base.model_dump(mode="json")
        raw.update(name="local-plain", emulation=None,
                   nodes=[{"name": "local", "devices": [d["name"] for d in raw["devices"]]}])
        base = type(base).model_validate(raw)
    spec_path = workdir / f"{name}.toml"
    spec_path.write_text(dump_cluster_toml(base))
    measured = RESULTS / f"collectives-{name}-measured.toml"
    subprocess.run([sys.executable, "-m", "hetsynth", "profile", "--cluster", str(spec_path), "-o",
                    str(measured)], cwd=ROOT, check=True, capture_output=True)
    return measured


def measure(spec_path: Path, sizes: list[int], reps: int, workdir: Path) -> list[dict]:
    from hetsynth.instruction_set.cluster import load_cluster
    from hetsynth.runtime.launch import launch_checked

    out = workdir / "records.json"
    launch_checked(load_cluster(spec_path), [str(ROOT / "bench" / "collectives_worker.py"), "--sizes",
                                             *map(str, sizes), "--skews", *map(str, SKEWS),
                                             "--reps", str(reps), "--out", str(out)], "measurement")
    return json.loads(out.read_text())


def predict(spec_path: Path, record: dict) -> float:
    from hetsynth.instruction_set.cluster import load_cluster
    from hetsynth.cost_models.comm import CommModel

    model = CommModel(load_cluster(spec_path), two_level=False)
    kind, variant = record["case"].split(".")
    shares = record["shares"]
    return model.cost(kind, variant, record["bytes"], at=shares).at(shares)


def analyse(env: str, spec_path: Path, records: list[dict]) -> tuple[list[list], dict]:
    groups = defaultdict(dict)
    for r in records:
        r["predicted"] = predict(spec_path, r)
        kind = r["case"].split(".")[0]
        groups[(kind, r["bytes"], round(r["shares"][0], 2))][r["case"].split(".")[1]] = r
    rows, right, total = [], 0, 0
    for (kind, nbytes, first), variants in sorted(groups.items()):
        if len(variants) < 2:
            continue
        fastest = min(variants, key=lambda v: variants[v]["seconds"])
        picked = min(variants, key=lambda v: variants[v]["predicted"])
        ok = variants[picked]["seconds"] <= 1.10 * variants[fastest]["seconds"]
        right += ok
        total += 1
        times = " ".join(f"{v}={variants[v]['seconds'] * 1e3:.1f}/{variants[v]['predicted'] * 1e3:.1f}"
                         for v in sorted(variants))
        rows.append([env, kind, f"{nbytes / 2**20:g} MiB", f"{first:.2f}", times, fastest, picked, "yes" if ok else "NO"])
    return rows, {"right": right, "total": total}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--envs", nargs="+", default=["emulated", "local"])
    parser.add_argument("--quick", action="store_true", help="sizes up to 1 MiB, one repetition")
    parser.add_argument("--sizes", type=int, nargs="+", help="message sizes in bytes (default 64 KiB to 64 MiB)")
    args = parser.parse_args()
    sizes = args.sizes or (SIZES[:2] if args.quick else SIZES)
    results, all_rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for env in args.envs:
            spec = environment(env, Path(tmp))
            records = measure(spec, sizes, 1 if args.quick else 9, Path(tmp))
            rows, score = analyse(env, spec, records)
            results[env] = {"records": records, "score": score, "spec": str(spec.relative_to(ROOT))}
            all_rows += rows
            print(f"{env}: the cost model picks the fastest variant (or one within 10%) in "
                  f"{score['right']} of {score['total']} cases", flush=True)
    header = ["env", "collective", "size", "first share", "measured/predicted ms per variant",
              "fastest", "picked", "ok"]
    print()
    print_table(all_rows, header)
    total = {k: sum(r["score"][k] for r in results.values()) for k in ("right", "total")}
    print(f"\noverall: {total['right']} of {total['total']} cases "
          f"({100 * total['right'] / max(total['total'], 1):.0f}%)")
    print("\n" + markdown_table(all_rows, header))
    write_json("collectives.json", {"environments": results, "overall": total})


if __name__ == "__main__":
    main()
