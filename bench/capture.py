"""Capture time and peak memory of every zoo preset, each in a fresh process.

    python bench/capture.py            # all presets of gpt, bert, vit, vgg, moe
Prints a table and writes bench/results/capture.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"

CHILD = """
import json, resource, time
from hetsynth import capture_model
start = time.perf_counter()
g = capture_model({ref!r})
seconds = time.perf_counter() - start
rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps({{"seconds": seconds, "peak_rss_gib": rss_gib, "params": g.num_params,
                  "ops": len(g.calls), "flops": sum(g.flops)}}))
"""


def main() -> None:
    from hetsynth.zoo import ZOO

    refs = [f"{m}:{p}" for m in ("gpt", "bert", "vit", "vgg", "moe") for p in ZOO[m].presets]
    rows = {}
    for ref in refs:
        out = subprocess.run([sys.executable, "-c", CHILD.format(ref=ref)], capture_output=True,
                             text=True, check=True)
        rows[ref] = json.loads(out.stdout.strip().splitlines()[-1])
        r = rows[ref]
        print(f"{ref:16s} {r['seconds']:7.2f} s  peak {r['peak_rss_gib']:5.2f} GiB  "
              f"params {r['params']:>14,}  ops {r['ops']:5d}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "capture.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
