"""Shared by the benchmarks: run a function in a fresh process (for peak memory), print a
table, write JSON to bench/results/."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]


def run_child(code: str, timeout_s: float = 1800) -> dict[str, Any]:
    """Run `code` (which prints one JSON line last) in a new interpreter at the repo root."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout_s, cwd=ROOT)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_table(rows: list[list[Any]], header: list[str]) -> None:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for i, r in enumerate(cells):
        print("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def markdown_table(rows: list[list[Any]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def print_tables(rows: list[list[Any]], header: list[str]) -> None:
    """The table as aligned text, then as Markdown (for the README)."""
    print()
    print_table(rows, header)
    print("\n" + markdown_table(rows, header))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine() -> dict[str, Any]:
    """This machine as a result records it: CPU model, logical cores, memory, GPU, torch."""
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        torch_version = torch.__version__
    except Exception:  # noqa: BLE001 - a result is still written without torch
        gpu, torch_version = "unknown", "not installed"
    return {"cpu": _cpu_model(), "logical_cores": os.cpu_count(), "memory_gib": _memory_gib(), "gpu": gpu,
            "torch": torch_version}


def commit() -> dict[str, Any]:
    """The commit the benchmark ran at, and whether the working tree had uncommitted changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT, timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"hash": "unknown"}
    return {"hash": head or "unknown", **({"dirty": True} if dirty else {})}


def meta() -> dict[str, Any]:
    """What bench/make_readme.py prints beside a result: the command that produced it, when, where
    and at which commit."""
    script = sys.argv[0] if sys.argv else ""
    if script and not script.startswith("-"):
        try:
            script = str(Path(script).resolve().relative_to(ROOT))
        except ValueError:
            pass
    return {"command": shlex.join(["python", script, *sys.argv[1:]]),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "commit": commit()}


def profiled(cluster: Path, force: bool = False) -> Path:
    """The measured spec of an emulated cluster spec (`hetsynth profile`), cached as
    bench/results/<name>-measured.toml; `force` measures again."""
    measured = RESULTS / f"{cluster.stem}-measured.toml"
    if force or not measured.exists():
        subprocess.run([sys.executable, "-m", "hetsynth", "profile", "--cluster", str(cluster), "-o", str(measured)],
                       cwd=ROOT, check=True)
    return measured


def write_json(name: str, data: Any) -> Path:
    """Write `data` to bench/results/NAME with a "meta" object (meta()) beside its figures."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / name
    if isinstance(data, dict):
        data = {**{k: v for k, v in data.items() if k != "meta"}, "meta": meta()}
    else:  # a list result: wrapped, so that it too carries its meta
        data = {"results": data, "meta": meta()}
    path.write_text(json.dumps(data, indent=2))
    return path


def compare_plans(cluster_path: Path, made: dict[str, Any], workdir: Path, rounds: int, steps: int) -> dict[str, Any]:
    """Train the plans `made` (name -> Plan) on the cluster's workers, interleaved
    (runtime.compare: 2 warm-up steps each, then `rounds` rounds of `steps` steps of each);
    its report: {name: {"step_seconds", "median_s", "phases_by_rank", ...}}."""
    import hetsynth
    from hetsynth.instruction_set.cluster import load_cluster
    from hetsynth.runtime.launch import launch_checked

    paths = []
    for name, plan in made.items():
        paths.append(str(workdir / f"{name}.json"))
        hetsynth.save_plan(plan, paths[-1])
    report = workdir / "compare.json"
    launch_checked(load_cluster(cluster_path),
                   ["-m", "hetsynth.runtime.compare", "--plans", *paths, "--names", *made, "--warmup", "2",
                    "--rounds", str(rounds), "--steps", str(steps), "--report", str(report)], "measurement",
                   timeout_s=1500)
    return json.loads(report.read_text())
