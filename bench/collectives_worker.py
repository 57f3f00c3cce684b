"""Worker of bench/collectives.py (run by torchrun): time every collective variant on all
ranks for the given sizes and skews; rank 0 writes the records as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hetsynth.instruction_set.mesh import Mesh  # noqa: E402
from hetsynth.profiling.profiler import measure_collectives  # noqa: E402
from hetsynth.runtime.groups import Groups  # noqa: E402
from hetsynth.runtime.rank import run_rank  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", required=True)
    p.add_argument("--skews", type=float, nargs="+", required=True, help="first member's share; 0 = even")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    sys.exit(run_rank(lambda rank, device: measure(rank, args), timeout_s=900, device=torch.device("cpu")))


def measure(rank: int, args: argparse.Namespace) -> None:
    world = dist.get_world_size()
    groups = Groups.create(Mesh(1, world, False), rank, world=dist.group.WORLD)
    skews = [None if s == 0 else (s, 1 - s) for s in args.skews]
    records = measure_collectives(groups, "all", args.sizes, torch.device("cpu"), args.reps, skews)
    if rank == 0:
        Path(args.out).write_text(json.dumps(records))


if __name__ == "__main__":
    main()
