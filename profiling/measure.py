"""Timing helpers shared by the cluster profiler (profiler.py) and the op profiler (op_profile.py).

Under a CPU quota a short call runs at full speed and the throttling falls between calls, so
timings are sustained: repetitions filling a time budget, timed as one block.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

# Dense matmul shapes of the sizes the zoo models use (M, K, N).
MATMULS = [(3072, 128, 512), (3072, 512, 128), (1024, 1024, 1024), (32, 3136, 1024)]


def device_sync(device: torch.device) -> Callable[[], None]:
    """What waits for the device's queued work: cuda synchronize, nothing on the CPU."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def sustained_seconds(fn: Callable[[], object], min_seconds: float, sync: Callable[[], None] = lambda: None,
                      min_calls: int = 3) -> float:
    """Seconds per call over repetitions filling at least min_seconds (after one warm-up)."""
    fn()
    sync()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds or count < min_calls:
        fn()
        count += 1
    sync()
    return (time.perf_counter() - start) / count


def matmul_throughput(device: torch.device, seconds: float) -> float:
    """FLOP/s: the best of the MATMULS shapes' sustained rates."""
    sync = device_sync(device)
    rates = []
    for m, k, n in MATMULS:
        a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
        rates.append(2 * m * k * n / sustained_seconds(lambda: a @ b, seconds, sync))
    return max(rates)


def memory_bandwidth(device: torch.device, seconds: float) -> float:
    """Bytes/s of a streaming elementwise add into a preallocated output (two 32 MiB reads,
    one 32 MiB write): a fresh output per call would time the allocator's page faults, which
    vary with the process's malloc state."""
    sync = device_sync(device)
    big = torch.randn(8 * 2**20, device=device)
    out = torch.empty_like(big)
    return 3 * big.numel() * 4 / sustained_seconds(lambda: torch.add(big, big, out=out), seconds, sync)
