"""Compare two plan_quality.json files row by row: the largest relative difference of the
predicted step times (hetsynth and every baseline) and the largest ratio difference.

    python bench/compare_plan_quality.py OLD NEW [--rel 1e-3]

Rows only in one file are listed; exits 1 when a shared row differs beyond --rel (a
restructuring must change no decision: expect 0 everywhere).
"""

from __future__ import annotations

import argparse
import json
import sys


def times(r: dict) -> dict[str, float]:
    return {"hetsynth": r["hetsynth_s"], **{k: v["step_time_s"] for k, v in r["baselines"].items()}}


def compare(old: dict, new: dict) -> tuple[float, float]:
    """(largest relative time difference, largest absolute ratio difference) of one row."""
    a, b = times(old), times(new)
    rel = max(abs(b[k] - a[k]) / abs(a[k]) for k in a)
    ratio = max((abs(x - y) for x, y in zip(old["ratios"], new["ratios"])), default=0.0)
    return rel, ratio


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--rel", type=float, default=1e-3)
    args = p.parse_args()
    old, new = (json.load(open(f)) for f in (args.old, args.new))
    worst = 0.0
    for key in sorted((set(old) | set(new)) - {"meta"}):  # meta: when and where, not a case
        if key not in old or key not in new or "error" in old[key] or "error" in new[key]:
            print(f"{key:28s} only in one file, or an error: {old.get(key, {}).get('error', '')}"
                  f"{new.get(key, {}).get('error', '')}")
            continue
        rel, ratio = compare(old[key], new[key])
        worst = max(worst, rel)
        print(f"{key:28s} time rel diff {rel:.3e}   ratio diff {ratio:.3e}")
    print(f"largest relative difference {worst:.3e} (tolerance {args.rel:g})")
    return 1 if worst > args.rel else 0


if __name__ == "__main__":
    sys.exit(main())
