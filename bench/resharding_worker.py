"""Worker of bench/resharding.py (run by torchrun on the emulated cluster): for every case,
repetition and method (order rotated every repetition) time one forward resharding from a
barrier until the last rank is done, then check every destination's values against the
arange tensor; rank 0 writes the records as JSON. Methods whose plans move the data the same
way (same chains) are run once per repetition and share the times (`same` in the record)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hetsynth.instruction_set.resharding import ReshardPlan, full_box  # noqa: E402
from hetsynth.runtime.rank import run_rank  # noqa: E402
from hetsynth.runtime.resharding import forward_exchange  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", required=True)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    sys.exit(run_rank(lambda rank, device: measure(rank, args), timeout_s=900, device=torch.device("cpu")))


def _source(plan: ReshardPlan, rank: int) -> torch.Tensor | None:
    spec = plan.spec
    if rank not in spec.src.ranks:
        return None
    t = torch.arange(torch.Size(spec.shape).numel(), dtype=torch.float64).reshape(spec.shape)
    return t[spec.src.box_of(rank).within(full_box(spec.shape))].clone()


def _correct(plan: ReshardPlan, rank: int, out: torch.Tensor | None) -> bool:
    spec = plan.spec
    if rank not in spec.dst.ranks:
        return True
    box = spec.dst.box_of(rank)
    t = torch.arange(torch.Size(spec.shape).numel(), dtype=torch.float64).reshape(spec.shape)
    return out is not None and torch.equal(out, t[box.within(full_box(spec.shape))])


def measure(rank: int, args: argparse.Namespace) -> None:
    cases = json.loads(Path(args.cases).read_text())
    records = []
    for case in cases:
        plans = {m: ReshardPlan.model_validate(p) for m, p in case["plans"].items()}
        x = _source(next(iter(plans.values())), rank)
        same = _same_schedule(plans)
        methods = [m for m in plans if same[m] == m]  # one run per distinct schedule
        times: dict[str, list[float]] = {m: [] for m in plans}
        correct = {}
        for rep in range(args.reps + 1):  # the first repetition warms the connections up
            for k in range(len(methods)):
                m = methods[(k + rep) % len(methods)]
                dist.barrier()
                t0 = time.perf_counter()
                out = forward_exchange(plans[m], rank, x, group=dist.group.WORLD) if _member(plans[m], rank) else None
                t1 = time.perf_counter()
                stamps = [None] * dist.get_world_size() if rank == 0 else None
                dist.gather_object((t0, t1) if _member(plans[m], rank) else None, stamps, dst=0)
                if rank == 0 and rep > 0:
                    got = [s for s in stamps if s is not None]
                    times[m].append(max(b for _, b in got) - min(a for a, _ in got))
                if rep == args.reps:
                    correct[m] = _correct(plans[m], rank, out)
        flags = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(correct, flags, dst=0)
        if rank == 0:
            records.append({"name": case["name"], "times": {m: times[same[m]] for m in plans},
                            "correct": {m: all(f[same[m]] for f in flags) for m in plans},
                            "same": {m: same[m] for m in plans if same[m] != m}})
    if rank == 0:
        Path(args.out).write_text(json.dumps(records))


def _same_schedule(plans: dict[str, ReshardPlan]) -> dict[str, str]:
    """Each method -> the first method whose plan moves the data the same way (same source
    reduction and chains): their runs are the same work, so it is run once for both."""
    first: dict[str, str] = {}
    out = {}
    for m, p in plans.items():
        key = json.dumps([p.model_dump(mode="json")[k] for k in ("source_reduction", "chains")])
        out[m] = first.setdefault(key, m)
    return out


def _member(plan: ReshardPlan, rank: int) -> bool:
    return rank in plan.spec.src.ranks or rank in plan.spec.dst.ranks


if __name__ == "__main__":
    main()
