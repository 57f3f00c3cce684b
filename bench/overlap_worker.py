"""Worker of bench/overlap.py (run by torchrun on an emulated cluster): time the matmul alone,
the unfused pair, k-slicing (k = 2, 4) and the fused ring of every case, interleaved; each
repetition's time is the slowest rank's. The matmul alone is chunked as the fused ring and
writes into one output as it does (x W^T chunk by chunk into views of y), and the unfused pair
runs the same chunks after (before) its collective: the pair's time less the matmul alone's is
then its communication, not also the difference between one GEMM and P chunks (on this machine,
one thread, one GEMM of all rows took 0.98-1.11x the time of two chunks over six case shapes:
up to a third of the smaller cases' communication). Rank 0 writes the records (medians) as JSON.

A case (JSON): {"name", "kind": "ag_matmul" | "matmul_rs", "lengths": [rows per member],
"hidden", "out", "reps" (optional: its repetitions, else --reps)}. ag_matmul: x (sum lengths,
hidden) split by rows, W (out, hidden), y = x W^T; matmul_rs: every rank holds x (sum lengths,
hidden) and W (out, hidden) (its slice of the contraction), y = sum over ranks of x W^T,
reduce-scattered by rows.
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

from hetsynth.runtime.collectives.fused import (ag_matmul_ring, ag_matmul_sliced, matmul_rs_ring,  # noqa: E402
                                       matmul_rs_sliced)
from hetsynth.runtime.collectives.gather import gather_padded  # noqa: E402
from hetsynth.runtime.collectives.scatter import scatter_padded  # noqa: E402
from hetsynth.runtime.collectives.span import Span  # noqa: E402
from hetsynth.runtime.rank import run_rank  # noqa: E402

VARIANTS = ("matmul", "unfused", "sliced2", "sliced4", "fused")


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed(fn: Callable[[], object]) -> float:
    TRACE.clear()
    dist.barrier()
    start = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - start)


def ag_variants(span: Span, case: dict) -> dict[str, Callable[[], object]]:
    lengths, offsets = span.lengths, span.offsets
    g = torch.Generator().manual_seed(span.index)
    x = torch.randn(span.my_length, case["hidden"], generator=g)
    w = torch.randn(case["out"], case["hidden"], generator=g)
    full = torch.randn(sum(lengths), case["hidden"], generator=g)

    @traced_by("chunk")
    def compute(j: int, start: int, rows: torch.Tensor, out: torch.Tensor) -> None:
        torch.mm(rows, w.t(), out=out)

    def y() -> torch.Tensor:
        return x.new_empty(sum(lengths), case["out"])

    def chunked(rows: torch.Tensor) -> torch.Tensor:
        """y = rows W^T chunk by chunk (the matmul alone on `full`, the unfused pair's after its
        gather)."""
        out = y()
        for j, n in enumerate(lengths):
            compute(j, 0, rows.narrow(0, offsets[j], n), out.narrow(0, offsets[j], n))
        return out

    gather = traced("collective", gather_padded)
    return {"matmul": lambda: chunked(full),
            "unfused": lambda: chunked(gather(x, span)),
            "sliced2": lambda: ag_matmul_sliced(x, span, compute, 2, y()),
            "sliced4": lambda: ag_matmul_sliced(x, span, compute, 4, y()),
            "fused": lambda: ag_matmul_ring(x, span, compute, y())}


def rs_variants(span: Span, case: dict) -> dict[str, Callable[[], object]]:
    lengths, offsets = span.lengths, span.offsets
    g = torch.Generator().manual_seed(span.index)
    x = torch.randn(sum(lengths), case["hidden"], generator=g)
    w = torch.randn(case["out"], case["hidden"], generator=g)

    @traced_by("chunk")
    def part(j: int) -> torch.Tensor:
        return x.narrow(0, offsets[j], lengths[j]) @ w.t()

    @traced_by("chunk")
    def part_rows(j: int, start: int, rows: int) -> torch.Tensor:
        return x.narrow(0, offsets[j] + start, rows) @ w.t()

    def parts() -> list[torch.Tensor]:
        return [part(j) for j in range(span.size)]

    scatter = traced("collective", scatter_padded)
    return {"matmul": parts,
            "unfused": lambda: scatter(torch.cat(parts()), span),
            "sliced2": lambda: matmul_rs_sliced(span, part_rows, 2),
            "sliced4": lambda: matmul_rs_sliced(span, part_rows, 4),
            "fused": lambda: matmul_rs_ring(span, part)}


TRACE: list[tuple[str, float, float]] = []  # (what, start, end) of the timed calls' matmuls, perf_counter


def traced(what: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """fn, recording each call's start and end in TRACE (a few microseconds a call)."""
    def run(*args: object) -> torch.Tensor:
        start = time.perf_counter()
        out = fn(*args)
        TRACE.append((what, start, time.perf_counter()))
        return out
    return run


def traced_by(what: str) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    return lambda fn: traced(what, fn)


def retransmitted() -> int:
    """TCP segments retransmitted so far in this network namespace (/proc/net/snmp)."""
    lines = [line.split() for line in Path("/proc/net/snmp").read_text().splitlines() if line.startswith("Tcp:")]
    return int(lines[1][lines[0].index("RetransSegs")])


def throttled_ms() -> float:
    """Milliseconds this process's CPU cgroup has been throttled so far (cgroup v1 cpu.stat; 0
    outside an emulated device's group)."""
    paths = [line.split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines()]
    group = next((path for _, controllers, path in paths if "cpu" in controllers.split(",")), None)
    stat = Path("/sys/fs/cgroup/cpu" + group) / "cpu.stat" if group else None
    if stat is None or not stat.exists():
        return 0.0
    fields = dict(l.split() for l in stat.read_text().splitlines())
    return int(fields.get("throttled_time", 0)) / 1e6


def trace_case(fns: dict[str, Callable[[], object]]) -> dict[str, list]:
    """One more call of every variant, each matmul's (what, start, end) in ms from the call's start,
    the call's end and the TCP segments retransmitted meanwhile in this namespace: where a fused
    call spends the time that the matmul alone does not."""
    out = {}
    for v, fn in fns.items():
        dist.barrier()
        TRACE.clear()
        lost, cpu, throttled = retransmitted(), time.thread_time(), throttled_ms()
        start = time.perf_counter()
        fn()
        end = time.perf_counter()
        out[v] = [[w, round((a - start) * 1e3, 3), round((b - start) * 1e3, 3)] for w, a, b in TRACE]
        out[v].append(["end", round((end - start) * 1e3, 3), retransmitted() - lost])
        out[v].append(["main_cpu_ms", round((time.thread_time() - cpu) * 1e3, 3), round(throttled_ms() - throttled, 3)])
    return out


def measure_case(span: Span, case: dict, reps: int, trace: bool = False) -> dict:
    fns = (ag_variants if case["kind"] == "ag_matmul" else rs_variants)(span, case)
    for fn in fns.values():  # warm up
        fn()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(reps):
        for v in VARIANTS:
            times[v].append(_timed(fns[v]))
    record = {**case, **{f"{v}_s": statistics.median(ts) for v, ts in times.items()},
              "samples": {v: ts for v, ts in times.items()}}
    if trace:
        traces: list = [None] * span.size
        dist.all_gather_object(traces, trace_case(fns))
        record["trace"] = traces
    return record


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", required=True, help="JSON file with the cases")
    p.add_argument("--reps", type=int, help="repetitions of every case (default: the case's \"reps\", else 5)")
    p.add_argument("--out", required=True)
    p.add_argument("--trace", action="store_true", help="record every rank's matmul intervals of one more call")
    args = p.parse_args()
    sys.exit(run_rank(lambda rank, device: run(rank, args), timeout_s=900, device=torch.device("cpu")))


def run(rank: int, args: argparse.Namespace) -> None:
    world = dist.get_world_size()
    records = []
    for case in json.loads(Path(args.cases).read_text()):
        span = Span(dist.group.WORLD, tuple(range(world)), rank, 0, tuple(case["lengths"]))
        records.append(measure_case(span, case, args.reps or case.get("reps", 5), args.trace))
    if rank == 0:
        Path(args.out).write_text(json.dumps(records))


if __name__ == "__main__":
    main()
