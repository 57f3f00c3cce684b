"""What an asynchronous collective in flight costs a device's compute: a share gamma of the
collective's time and a fixed cost per message (instruction_set.cluster.DeviceKind
.transfer_cpu_share and .transfer_cpu_us_per_message; the cost model charges
gamma_i S_b + m_i k_b to the compute of the overlapped backward, planner.step_cost).

Every rank, all at once, on the group of all ranks (the slowest links: what a data-parallel
gradient bucket crosses), for each case (k messages of n bytes, CASES):

    S  = seconds of k all-reduces of n bytes, issued back to back and waited (the slowest
         rank's time)
    C  = seconds of a block of matmuls (a zoo-sized shape) sized to last about 3 S + 0.2 s,
         so that the transfers end inside it
    C' = seconds of the same block with the k all-reduces launched asynchronously just before
         it (waited after it)
    lost = median over REPS pairs of (C' - C)    (each pair back to back: a CPU quota's
                                                   throttling is noisy, drift cancels)

and `lost = m k + gamma S` is fitted over the cases of all ranks of a device kind by
non-negative least squares (profiling.profiler.fit_transfer_cpu), gamma clamped to [0, 1]. On CPU workers gloo's transfer
threads take their CPU from the compute's own quota, and each message wakes them (under a
fractional quota a wake-up can cost a throttling period); a GPU whose bytes move by NCCL
beside the compute loses little of either. Written by us: no library measures this.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from profiling.measure import device_sync, sustained_seconds

CASES = ((64 * 2**10, 8), (2**20, 1), (4 * 2**20, 1))  # (bytes, messages): many small, a few large
REPS = 5
SHAPE = (1024, 1024, 1024)


def _timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _slowest(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _launch(flats: list[torch.Tensor], group: Any) -> list[Any]:
    return [dist.all_reduce(f, group=group, async_op=True) for f in flats]


def _lost(nbytes: int, messages: int, group: Any, device: torch.device) -> tuple[float, float]:
    """(S, lost) of one case on this rank (module docstring)."""
    sync = device_sync(device)
    m, k, n = SHAPE
    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    flats = [torch.zeros(nbytes // 4, device=device) for _ in range(messages)]
    transfer = _slowest(statistics.median(
        _timed(lambda: [w.wait() for w in _launch(flats, group)], sync) for _ in range(REPS)), device)
    calls = math.ceil((3 * transfer + 0.2) / sustained_seconds(lambda: a @ b, 0.05, sync))

    def block() -> None:
        for _ in range(calls):
            a @ b

    def with_transfer() -> float:
        dist.barrier()
        start = time.perf_counter()
        works = _launch(flats, group)
        block()
        sync()
        elapsed = time.perf_counter() - start  # the block's time; the transfers' tail is not compute
        for w in works:
            w.wait()
        return elapsed

    return transfer, statistics.median(with_transfer() - _timed(block, sync) for _ in range(REPS))


def transfer_cpu_rows(group: Any, device: torch.device) -> list[tuple[int, float, float]]:
    """This rank's (k, S, lost) of every case; every rank of `group` calls it (collective)."""
    return [(messages, *_lost(nbytes, messages, group, device)) for nbytes, messages in CASES]


__all__ = ["CASES", "REPS", "transfer_cpu_rows"]
