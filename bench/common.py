"""Shared by the benchmarks: run a function in a fresh process (for peak memory), print a
table, write JSON to bench/results/."""

from __future__ import annotations

import json
import subprocess
import sys
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


def write_json(name: str, data: Any) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(data, indent=2))
    return path
