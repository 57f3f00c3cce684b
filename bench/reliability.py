"""Reliability of `hetsynth run`: repeated successful runs print no traceback, and every fault
is detected and reported, with how long each takes.

    python bench/reliability.py [--runs 20] [--steps 2] [--skip-faults] [--skip-runs]

Runs (the emulated cluster of configs/clusters/local-emulated.toml when root, else plain local
processes): the default plan of `gpt:tiny` is trained `--runs` times in a row with
`hetsynth run`; each run's exit status, seconds and whether its output holds a traceback
(`Traceback`, torchrun's `Error waiting on exit barrier`) are recorded.

Faults (each under a hard outer timeout), seconds from the fault to the command's exit, on
the two-level default plan and a single-level plan (the first node's two devices), with
`--timeout 10`:
- rank 1 SIGSTOPped or SIGKILLed from outside once step 2 is printed, or raising an error at
  the start of the next step (HETSYNTH_FAULT; timed from the step-2 line);
- `hetsynth run` itself SIGKILLed after its first step, then `hetsynth cleanup` (timed): how
  many of the things its run record lists existed before the cleanup, and after;
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
    from hetsynth.instruction_set.cluster import load_cluster

    cluster = load_cluster(CLUSTER)
    api.save_plan(api.plan("gpt:tiny", cluster=cluster.first(devices) if devices else cluster, stages=1), path)


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


def rank_pid(plan: Path, rank: int) -> int:
    from hetsynth.runtime.heartbeat import run_ranks

    ranks = run_ranks(str(plan))
    if rank not in ranks:
        raise RuntimeError(f"no worker of rank {rank} for {plan}")
    return ranks[rank].pid


def fault_run(plan: Path, how: str, timeout_s: int = 10) -> dict:
    """Train `plan`; after step 2 appears, rank 1 is SIGSTOPped or SIGKILLed from outside,
    or raises (HETSYNTH_FAULT, at the start of step index 2). Seconds from then to the exit."""
    env = os.environ | ({"HETSYNTH_FAULT": "1:2:raise"} if how == "raise" else {})
    proc = subprocess.Popen([sys.executable, "-m", "hetsynth", "run", str(plan), "--steps", "1000", "--timeout",
                             str(timeout_s)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=env)
    text = ""
    for line in proc.stdout:
        text += line
        if "step    2/" in line:
            break
    start = time.monotonic()
    if how != "raise":
        os.kill(rank_pid(plan, 1), {"stop": signal.SIGSTOP, "kill": signal.SIGKILL}[how])
    try:
        text += proc.communicate(timeout=timeout_s + 120)[0]
    finally:
        proc.kill()
    line = next((x for x in text.splitlines() if x.startswith("hetsynth run:")), "")
    return {"exit": proc.returncode, "seconds": round(time.monotonic() - start, 1), "line": line,
            "traceback": "Traceback" in text}


def killed_launcher(plan: Path) -> dict:
    """SIGKILL `hetsynth run` after its first step; what its record lists still exists, then
    `hetsynth cleanup` (timed), then what still exists."""
    from hetsynth.runtime.runstate import state_dir

    proc = subprocess.Popen([sys.executable, "-m", "hetsynth", "run", str(plan), "--steps", "1000"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    for line in proc.stdout:
        if "step    1/" in line:
            break
    created = json.loads(next(state_dir().glob(f"{proc.pid}-*.json")).read_text())["created"]
    proc.kill()
    proc.wait()
    before = sum(1 for kind, name in created if exists(kind, name))
    rc, text, seconds = hetsynth("cleanup")
    after = [f"{kind} {name}" for kind, name in created if exists(kind, name)]
    return {"exit": rc, "seconds": round(seconds, 1), "line": text.strip().splitlines()[0],
            "recorded": len(created), "left_before_cleanup": before, "left_after_cleanup": after}


def exists(kind: str, name: str) -> bool:
    from hetsynth.runtime.emulation import leftovers
    from hetsynth.runtime.names import process_state

    if kind == "session":  # a zombie (killed, its parent not yet told) is gone
        pid, start = name.split(":")
        return process_state(int(pid), int(start)) is not None
    if kind in ("netns", "veth"):
        found = leftovers()
        return name in found["namespaces"] + found["veths"]
    return Path(name).exists()


def bad_input(plan: Path, tmp: Path, case: str) -> dict:
    bad = tmp / "garbage.pt"
    bad.write_bytes(os.urandom(4096))
    args = {"bad --save": ["--save", "/proc/ck.pt"], "corrupt --resume": ["--resume", str(bad)]}[case]
    rc, text, seconds = hetsynth("run", str(plan), "--steps", "20", *args)
    return {"exit": rc, "seconds": round(seconds, 1), "line": text.strip().splitlines()[-1], "traceback": "Traceback" in text}


def faults(tmp: Path) -> list[dict]:
    single = tmp / "single.json"
    make_plan(single, devices=2)
    two = tmp / "plan.json"
    rows = [{"fault": f"rank 1 {how}", "plan": name, **fault_run(path, how)}
            for how in ("stop", "kill", "raise") for name, path in (("two-level", two), ("single-level", single))]
    rows.append({"fault": "hetsynth run SIGKILLed, then hetsynth cleanup", "plan": "two-level", **killed_launcher(two)})
    rows += [{"fault": case, "plan": "two-level", **bad_input(two, tmp, case)} for case in ("bad --save", "corrupt --resume")]
    for r in rows:
        print(f"{r['fault']:48s} {r['plan']:12s} exit {r['exit']:3d} {r['seconds']:6.1f} s  {r['line'][:150]}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--skip-faults", action="store_true")
    p.add_argument("--skip-runs", action="store_true")
    args = p.parse_args()
    from hetsynth.runtime.emulation import unavailable

    result: dict = {"emulated": unavailable() is None}
    with tempfile.TemporaryDirectory(prefix="hetsynth-bench-") as tmp:
        plan = Path(tmp) / "plan.json"
        make_plan(plan)
        if not args.skip_faults:
            rows = result["faults"] = faults(Path(tmp))
            print_tables([[r["fault"], r["plan"], r["exit"], r["seconds"], r["line"].replace("|", "/")[:120]]
                          for r in rows], ["fault", "plan", "exit", "seconds to exit", "message"])
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
