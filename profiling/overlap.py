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
non-negative least squares (profiling.profiler.fit_transfer_cpu), gamma clamped to [0, 1].

The same measurement with point-to-point messages instead (P2P_CASES, p2p_cpu_rows: each rank
sends k messages to its partner on the next node and receives k from the previous node's, as a
pipeline stage's boundary activations and gradients cross; k = 2k messages in the fit) gives
DeviceKind.p2p_cpu_share and .p2p_cpu_us_per_message, what planner.stage_times charges a
boundary transfer. An all-reduce's message is not a point-to-point one: its ring steps each
send and receive, and gloo's pairs wake differently. On CPU workers gloo's transfer
threads take their CPU from the compute's own quota, and each message wakes them (under a
fractional quota a wake-up can cost a throttling period); a GPU whose bytes move by NCCL
beside the compute loses little of either. Written by us: no library measures this.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hetsynth.profiling.measure import device_sync, sustained_seconds

CASES = ((64 * 2**10, 8), (2**20, 1), (4 * 2**20, 1))  # (bytes, messages): many small, a few large
P2P_CASES = ((128 * 2**10, 4), (128 * 2**10, 1), (2**20, 1))  # pipeline boundary messages
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


def _lost(nbytes: int, messages: int, launch: Callable[[list[torch.Tensor]], list[Any]],
          device: torch.device) -> tuple[float, float]:
    """(S, lost) of one case on this rank (module docstring)."""
    sync = device_sync(device)
    m, k, n = SHAPE
    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    flats = [torch.zeros(nbytes // 4, device=device) for _ in range(messages)]
    transfer = _slowest(statistics.median(
        _timed(lambda: [w.wait() for w in launch(flats)], sync) for _ in range(REPS)), device)
    calls = math.ceil((3 * transfer + 0.2) / sustained_seconds(lambda: a @ b, 0.05, sync))

    def block() -> None:
        for _ in range(calls):
            a @ b

    def with_transfer() -> float:
        dist.barrier()
        start = time.perf_counter()
        works = launch(flats)
        block()
        sync()
        elapsed = time.perf_counter() - start  # the block's time; the transfers' tail is not compute
        for w in works:
            w.wait()
        return elapsed

    return transfer, statistics.median(with_transfer() - _timed(block, sync) for _ in range(REPS))


def transfer_cpu_rows(group: Any, device: torch.device) -> list[tuple[int, float, float]]:
    """This rank's (k, S, lost) of every case; every rank of `group` calls it (collective)."""
    return [(messages, *_lost(nbytes, messages, _all_reduces(group), device)) for nbytes, messages in CASES]


def _all_reduces(group: Any) -> Callable[[list[torch.Tensor]], list[Any]]:
    return lambda flats: [dist.all_reduce(f, group=group, async_op=True) for f in flats]


def partners(nodes: Sequence[int], rank: int) -> tuple[int, int] | None:
    """(to, from): the ranks at this rank's position on the next and the previous node (a ring
    over the nodes); None where a node has no rank at that position or there is one node."""
    order = sorted(set(nodes))
    on = {j: [r for r, n in enumerate(nodes) if n == j] for j in order}
    i, pos = order.index(nodes[rank]), on[nodes[rank]].index(rank)
    nxt, prv = on[order[(i + 1) % len(order)]], on[order[i - 1]]
    if len(order) < 2 or len(nxt) <= pos or len(prv) <= pos:
        return None
    return nxt[pos], prv[pos]


def _point_to_point(to: int, frm: int) -> Callable[[list[torch.Tensor]], list[Any]]:
    """k sends to `to` and k receives from `frm`, each into its own buffer (a pipeline
    boundary's activations one way, gradients the other), posted at once."""
    def launch(flats: list[torch.Tensor]) -> list[Any]:
        inbox = [torch.empty_like(f) for f in flats]
        return [w for f, x in zip(flats, inbox) for w in (dist.isend(f, to), dist.irecv(x, frm))]
    return launch


def p2p_cpu_rows(nodes: Sequence[int], rank: int, device: torch.device) -> list[tuple[int, float, float]]:
    """This rank's (messages, S, lost) of every P2P_CASES case: k boundary-sized messages sent to
    the next node and k received from the previous one (2k messages), with point-to-point
    isend/irecv as runtime.pipeline moves boundary tensors; every rank calls it (collective).
    Empty where partners() has none; then every rank skips it."""
    pair = partners(nodes, rank)
    everyone = all(partners(nodes, r) is not None for r in range(len(nodes)))
    if pair is None or not everyone:
        return []
    return [(2 * k, *_lost(nbytes, k, _point_to_point(*pair), device)) for nbytes, k in P2P_CASES]


__all__ = ["CASES", "P2P_CASES", "REPS", "p2p_cpu_rows", "partners", "transfer_cpu_rows"]
