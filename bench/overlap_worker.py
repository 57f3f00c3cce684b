"""Worker of bench/overlap.py (run by torchrun on an emulated cluster): time the matmul alone,
the unfused pair, k-slicing (k = 2, 4) and the fused ring of every case, interleaved; each
repetition's time is the slowest rank's. Rank 0 writes the records (medians) as JSON.

A case (JSON): {"name", "kind": "ag_matmul" | "matmul_rs", "lengths": [rows per member],
"hidden", "out"}. ag_matmul: x (sum lengths, hidden) split by rows, W (out, hidden),
y = x W^T; matmul_rs: every rank holds x (sum lengths, hidden) and W (out, hidden) (its slice
of the contraction), y = sum over ranks of x W^T, reduce-scattered by rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from runtime.collectives.fused import (ag_matmul_ring, ag_matmul_sliced, matmul_rs_ring,  # noqa: E402
                                       matmul_rs_sliced)
from runtime.collectives.gather import gather_padded  # noqa: E402
from runtime.collectives.scatter import scatter_padded  # noqa: E402
from runtime.collectives.span import Span  # noqa: E402
from runtime.rank import run_rank  # noqa: E402

VARIANTS = ("matmul", "unfused", "sliced2", "sliced4", "fused")


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed(fn: Callable[[], object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - start)


def ag_variants(span: Span, case: dict) -> dict[str, Callable[[], object]]:
    lengths, offsets = span.lengths, [span.offset(j) for j in range(span.size)]
    g = torch.Generator().manual_seed(span.index)
    x = torch.randn(span.my_length, case["hidden"], generator=g)
    w = torch.randn(case["out"], case["hidden"], generator=g)
    full = torch.randn(sum(lengths), case["hidden"], generator=g)

    def compute(j: int, start: int, rows: torch.Tensor) -> torch.Tensor:
        return rows @ w.t()

    return {"matmul": lambda: [compute(j, 0, full.narrow(0, offsets[j], n)) for j, n in enumerate(lengths)],
            "unfused": lambda: gather_padded(x, span) @ w.t(),
            "sliced2": lambda: ag_matmul_sliced(x, span, compute, 2),
            "sliced4": lambda: ag_matmul_sliced(x, span, compute, 4),
            "fused": lambda: ag_matmul_ring(x, span, compute)}


def rs_variants(span: Span, case: dict) -> dict[str, Callable[[], object]]:
    lengths, offsets = span.lengths, [span.offset(j) for j in range(span.size)]
    g = torch.Generator().manual_seed(span.index)
    x = torch.randn(sum(lengths), case["hidden"], generator=g)
    w = torch.randn(case["out"], case["hidden"], generator=g)

    def part(j: int) -> torch.Tensor:
        return x.narrow(0, offsets[j], lengths[j]) @ w.t()

    def part_rows(j: int, start: int, rows: int) -> torch.Tensor:
        return x.narrow(0, offsets[j] + start, rows) @ w.t()

    return {"matmul": lambda: [part(j) for j in range(span.size)],
            "unfused": lambda: scatter_padded(x @ w.t(), span),
            "sliced2": lambda: matmul_rs_sliced(span, part_rows, 2),
            "sliced4": lambda: matmul_rs_sliced(span, part_rows, 4),
            "fused": lambda: matmul_rs_ring(span, part)}


def measure_case(span: Span, case: dict, reps: int) -> dict:
    fns = (ag_variants if case["kind"] == "ag_matmul" else rs_variants)(span, case)
    for fn in fns.values():  # warm up
        fn()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(reps):
        for v in VARIANTS:
            times[v].append(_timed(fns[v]))
    return {**case, **{f"{v}_s": statistics.median(ts) for v, ts in times.items()},
            "samples": {v: ts for v, ts in times.items()}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", required=True, help="JSON file with the cases")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    sys.exit(run_rank(lambda rank, device: run(rank, args), timeout_s=900, device=torch.device("cpu")))


def run(rank: int, args: argparse.Namespace) -> None:
    world = dist.get_world_size()
    records = []
    for case in json.loads(Path(args.cases).read_text()):
        span = Span(dist.group.WORLD, tuple(range(world)), rank, 0, tuple(case["lengths"]))
        records.append(measure_case(span, case, args.reps))
    if rank == 0:
        Path(args.out).write_text(json.dumps(records))


if __name__ == "__main__":
    main()
