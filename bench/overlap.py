"""CommFuse measured: all-gather -> matmul and matmul -> reduce-scatter as the unfused pair, as
k-slicing (k = 2, 4) and as the fused ring (runtime.collectives.fused), beside the matmul
alone, on the emulated cluster (needs root), inside a node and across the shaped link.

    python bench/overlap.py [--pilot] [--reps N]

Environments (generated from bench/results/local-emulated-measured.toml, its measured device
kinds and links):
  inside  one node, 2 cpu-fast workers (0.5 CPU each), loopback
  across  two nodes of one cpu-fast worker each, 200 Mbit/s shaped link
The exposed communication fraction of a variant is (variant - matmul) / (unfused - matmul).
`--pilot` runs a few cases per environment and only prints.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from common import RESULTS, ROOT, print_table

sys.path.insert(0, str(ROOT))

BASE = RESULTS / "local-emulated-measured.toml"
TOKENS = 2048


def environment(name: str, workdir: Path) -> Path:
    """The spec of an environment (module docstring), written to workdir."""
    from instruction_set.cluster import dump_cluster_toml, load_cluster

    raw = load_cluster(BASE).model_dump(mode="json", exclude_none=True)
    if name == "inside":
        raw["devices"] = [{"name": "fast/0", "kind": "cpu-fast"}, {"name": "fast/1", "kind": "cpu-fast"}]
        raw["nodes"] = [{"name": "fast", "devices": ["fast/0", "fast/1"]}]
    else:
        raw["devices"] = [{"name": "a/0", "kind": "cpu-fast"}, {"name": "b/0", "kind": "cpu-fast"}]
        raw["nodes"] = [{"name": "a", "devices": ["a/0"]}, {"name": "b", "devices": ["b/0"]}]
    raw["name"] = f"overlap-{name}"
    spec = type(load_cluster(BASE)).model_validate(raw)
    path = workdir / f"{name}.toml"
    path.write_text(dump_cluster_toml(spec))
    return path


def measure(spec_path: Path, cases: list[dict], reps: int, workdir: Path) -> list[dict]:
    from instruction_set.cluster import load_cluster
    from runtime.launch import launch_checked

    case_file, out = workdir / "cases.json", workdir / "records.json"
    case_file.write_text(json.dumps(cases))
    launch_checked(load_cluster(spec_path), [str(ROOT / "bench" / "overlap_worker.py"), "--cases", str(case_file),
                                             "--reps", str(reps), "--out", str(out)], "overlap measurement")
    return json.loads(out.read_text())


def pilot_cases(env: str) -> list[dict]:
    outs = (128, 1024) if env == "inside" else (1024, 4096)
    half = TOKENS // 2
    return [{"name": f"{env}-ag-o{o}", "kind": "ag_matmul", "lengths": [half, half], "hidden": 1024, "out": o}
            for o in outs] + [{"name": f"{env}-rs-h{h}", "kind": "matmul_rs", "lengths": [half, half],
                               "hidden": h, "out": 1024} for h in (256, 2048)]


def exposed(r: dict, variant: str) -> float:
    comm = r["unfused_s"] - r["matmul_s"]
    return (r[f"{variant}_s"] - r["matmul_s"]) / comm if comm > 0 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pilot", action="store_true")
    parser.add_argument("--envs", nargs="+", default=["inside", "across"])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for env in args.envs:
            spec = environment(env, Path(tmp))
            for r in measure(spec, pilot_cases(env), args.reps, Path(tmp)):
                rows.append([r["name"], *(f"{r[v + '_s'] * 1e3:.1f}" for v in
                                          ("matmul", "unfused", "sliced2", "sliced4", "fused")),
                             *(f"{exposed(r, v):.2f}" for v in ("sliced2", "sliced4", "fused"))])
    print_table(rows, ["case", "matmul ms", "unfused ms", "sliced2 ms", "sliced4 ms", "fused ms",
                       "exp sliced2", "exp sliced4", "exp fused"])


if __name__ == "__main__":
    main()
