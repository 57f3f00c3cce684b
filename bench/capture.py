"""Capture time and peak memory of every zoo preset, each in a fresh process.

    python bench/capture.py                        # all presets of gpt, bert, vit, vgg, moe
    python bench/capture.py --against main         # and the same presets captured by `main`'s
                                                   # code, interleaved, with the time ratio

With `--against REV` the code of that git revision is extracted to a temporary directory and
every preset is captured `--repeats` times by each code base, alternating which goes first,
so both see the same machine load; the table gives the medians and new / old. Prints a table
and writes bench/results/capture.json.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ROOT, print_tables, run_child, write_json  # noqa: E402

FAMILIES = ("gpt", "bert", "vit", "vgg", "moe")

CHILD = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
import hetsynth.planner as planner
assert planner.__file__.startswith({root!r}), planner.__file__
from hetsynth import capture_model
start = time.perf_counter()
g = capture_model({ref!r})
seconds = time.perf_counter() - start
rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps({{"seconds": seconds, "peak_rss_gib": rss_gib, "params": g.num_params,
                  "ops": len(g.calls), "flops": sum(g.flops)}}))
"""


def capture_once(ref: str, root: Path) -> dict[str, Any]:
    """One capture of `ref` by the code under `root`, in a fresh interpreter."""
    out = run_child(CHILD.format(root=str(root), ref=ref))
    if "error" in out:
        raise RuntimeError(f"{ref} ({root}): {out['error']}")
    return out


def extract(rev: str, into: Path) -> Path:
    """The tree of git revision `rev` under `into` (git archive, nothing checked out here)."""
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def measure(ref: str, repeats: int, base: Path | None) -> dict[str, Any]:
    """Medians of `repeats` captures by this code (and by `base`'s, interleaved)."""
    new, old = [], []
    for i in range(repeats):
        pair = [("new", ROOT), ("old", base)] if i % 2 == 0 else [("old", base), ("new", ROOT)]
        for which, root in pair:
            if root is not None:
                (new if which == "new" else old).append(capture_once(ref, root))
    row = dict(new[-1], seconds=statistics.median(r["seconds"] for r in new),
               peak_rss_gib=max(r["peak_rss_gib"] for r in new), runs=[r["seconds"] for r in new])
    if old:
        row["baseline"] = dict(old[-1], seconds=statistics.median(r["seconds"] for r in old),
                               runs=[r["seconds"] for r in old])
        row["ratio"] = row["seconds"] / row["baseline"]["seconds"]
    return row


def table_row(ref: str, r: dict[str, Any]) -> list[Any]:
    b = r.get("baseline")
    return [ref, f"{r['seconds']:.2f}", f"{r['peak_rss_gib']:.2f}", f"{r['params']:,}", r["ops"],
            f"{b['seconds']:.2f}" if b else "-", b["ops"] if b else "-", f"{r['ratio']:.2f}" if b else "-"]


def main(argv: list[str] | None = None) -> None:
    from hetsynth.zoo import ZOO

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="a git revision whose capture to time alongside, interleaved")
    parser.add_argument("--repeats", type=int, default=None, help="captures per preset and code (default 1, "
                                                                   "3 with --against)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.against else 1)
    refs = [f"{m}:{p}" for m in FAMILIES for p in ZOO[m].presets]
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="hetsynth-capture-") as tmp:
        base = extract(args.against, Path(tmp)) if args.against else None
        for ref in refs:
            rows[ref] = measure(ref, repeats, base)
            print(" ".join(str(c) for c in table_row(ref, rows[ref])), flush=True)
    header = ["preset", "seconds", "peak GiB", "parameters", "ops", f"{args.against or 'base'} s", "base ops",
              "new / base"]
    print_tables([table_row(ref, r) for ref, r in rows.items()], header)
    ratios = [r["ratio"] for r in rows.values() if "ratio" in r]
    if ratios:
        print(f"\ntime ratio new / {args.against}: median {statistics.median(ratios):.2f}, "
              f"max {max(ratios):.2f} ({max(rows, key=lambda k: rows[k].get('ratio', 0))})")
    write_json("capture.json", {"against": args.against, "repeats": repeats, "presets": rows})


if __name__ == "__main__":
    main()
