"""Measure a cluster: device throughput and alpha-beta of every collective variant.

Run on every rank (`hetsynth profile`, via profiling.profile_worker), on an emulated cluster
inside its quotas and shaped links, or on a real one (NCCL on GPUs):

- compute: dense matmuls of the sizes the zoo models use (FLOP/s, the best of the sizes'
  sustained rates, profiling.measure), the same in every other dtype the device runs
  (tf32, bfloat16, float16, float8: the kind's matmul_flops, profiling.matmul_dtypes), a
  large elementwise add (memory bandwidth), a tiny op (per-op launch overhead, what eager
  execution of a captured graph pays per op);
- communication: every collective variant of the runtime, on all ranks (link class "inter"
  when the cluster has several nodes), on each node's ranks ("intra") and on the cross-node
  groups ("outer"), for messages of 64 KiB to 16 MiB (64 MiB with `--max-bytes`) and shards
  from even to skewed, the variants of one size and skew back to back; then for each
  (variant, link class) the alpha and beta of the cost model's own formula (cost_models.comm,
  with the nodes of the ranks for "inter") fitted by least squares on relative error:
      t = k_alpha * alpha + k_bytes(shares, D) / beta,
  the errors of messages beyond 1 MiB weighted up (fit_weight: a shaped link's burst makes
  small messages look faster than the sustained bandwidth).

Rank 0 writes the spec with the measured figures (device kinds marked measured) and the
calibration; it loads like any other spec.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from hetsynth.cost_models.comm import collective_terms
from hetsynth.instruction_set.calibration import AlphaBeta, Calibration
from hetsynth.instruction_set.cluster import ClusterSpec
from hetsynth.instruction_set.matmul_rates import Dtype
from hetsynth.instruction_set.shards import largest_remainder
from hetsynth.profiling.matmul_dtypes import dtype_rates, measured_rates
from hetsynth.profiling.measure import device_sync, matmul_throughput, memory_bandwidth, sustained_seconds
from hetsynth.runtime.collectives import Span, all_gather, all_to_all, reduce_scatter
from hetsynth.runtime.collectives.allreduce import reduce_ring
from hetsynth.runtime.groups import Groups

OTHER_DTYPES = tuple(d for d in Dtype if d is not Dtype.FLOAT32)  # float32 is throughput_flops
SKEWS = [None, (0.9, 0.1)]  # even shards, and 90/10 between the first member and the rest
BUDGET_S = 1.5  # seconds of repetitions per measurement, at least one


def _time_collective(fn: Callable[[], object], reps: int, device: torch.device, calls: int = 1,
                     budget_s: float = BUDGET_S) -> float:
    """Median seconds of a collective over up to `reps` repetitions of `calls` calls each,
    after one warm-up; a repetition lasts until the last rank is done (the max over ranks:
    with uneven shards one rank can finish long before the others, for example the owner
    of a big shard that only receives small ones). Several calls per repetition average out
    the CPU-quota throttling (a 10 ms period) of short messages; long messages stop
    repeating once `budget_s` is spent. The ranks agree before each repetition (a 1-element
    all-reduce, which also lines up their starts) so that all run the same calls."""
    sync = device_sync(device)
    fn()
    sync()
    times: list[float] = []
    spent = 0.0
    while len(times) < reps and _agree(not times or spent < budget_s, device):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        elapsed = time.perf_counter() - start
        spent += elapsed
        times.append(elapsed / calls)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


def _agree(go_on: bool, device: torch.device) -> bool:
    """Whether any rank wants another repetition (every rank then runs it)."""
    flag = torch.tensor([1.0 if go_on else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def calls_per_rep(nbytes: int) -> int:
    """Calls per timed repetition: about 1 MiB of traffic, at most 16 calls."""
    return max(1, min(16, 2**20 // max(nbytes, 1)))


def measure_compute(device: torch.device, seconds: float) -> dict[str, float]:
    sync = device_sync(device)
    bandwidth = memory_bandwidth(device, seconds)
    tiny = torch.ones(1, device=device)
    launch = sustained_seconds(lambda: tiny + tiny, seconds / 4, sync)
    return {"throughput_flops": matmul_throughput(device, seconds), "memory_bandwidth_gbyte_s": bandwidth / 1e9,
            "kernel_launch_us": launch * 1e6, "matmul_flops": dtype_rates(device, seconds / 4, dtypes=OTHER_DTYPES)}


def _shares(g: int, skew: tuple[float, float] | None) -> list[float]:
    if skew is None:
        return [1.0 / g] * g
    return [skew[0]] + [skew[1] / (g - 1)] * (g - 1)


CASES: dict[str, Callable] = {
    "all_gather.padded": lambda x, s, d: all_gather(x, s, "padded"),
    "all_gather.grouped": lambda x, s, d: all_gather(x, s, "grouped"),
    "all_gather.ring": lambda x, s, d: all_gather(x, s, "ring"),
    "reduce_scatter.padded": lambda x, s, d: reduce_scatter(x, s, "padded"),
    "reduce_scatter.grouped": lambda x, s, d: reduce_scatter(x, s, "grouped"),
    "reduce_scatter.ring": lambda x, s, d: reduce_scatter(x, s, "ring"),
    "all_reduce.ring": lambda x, s, d: reduce_ring(x, s),
    "all_to_all.native": lambda x, s, d: all_to_all(x, s, d),
}


def _input(case: str, span: Span, rows: int, cols: int, device: torch.device) -> tuple:
    kind = case.split(".")[0]
    if kind == "all_gather":
        return torch.randn(span.my_length, cols, device=device), span, None
    if kind == "all_to_all":
        dst = Span(span.group, span.members, span.index, 1, span.lengths)
        src = Span(span.group, span.members, span.index, 0, span.lengths)
        return torch.randn(span.my_length, rows, device=device), src, dst
    return torch.randn(rows, cols, device=device), span, None


def measure_collectives(groups: Groups, axis: str, sizes: Sequence[int], device: torch.device,
                        reps: int, skews: Sequence[tuple[float, float] | None] = SKEWS) -> list[dict]:
    """Time every case on my group along `axis` for each size and skew (the first member's
    share, the rest split evenly); every rank calls it (collective)."""
    g = len(groups.members(axis))
    out = []
    # the variants of one size and skew are timed one after the other, so that a comparison
    # between them sees the same machine
    for nbytes in sizes:
        for skew in skews:
            for case, fn in CASES.items():
                cols = 64
                rows = max(g, nbytes // (4 * cols))
                if case.startswith("all_to_all"):  # a square [rows, rows] tensor, S0 -> S1
                    rows = cols = max(g, math.isqrt(nbytes // 4))
                shares = _shares(g, skew)
                lengths = tuple(largest_remainder(shares, rows))
                span = Span(groups.group(axis), tuple(groups.members(axis)), groups.index(axis), 0, lengths)
                x, s, d = _input(case, span, rows, cols, device)
                dist.barrier()
                t = _time_collective(lambda: fn(x, s, d), reps, device, calls_per_rep(nbytes))
                out.append({"case": case, "bytes": rows * cols * 4, "shares": [n / rows for n in lengths],
                            "group": g, "seconds": t})
    return out


def fit(records: Sequence[dict], link_class: str, nodes: Sequence[int] | None = None) -> dict[str, AlphaBeta]:
    """Least-squares alpha and beta per case from the cost model's formulas; `nodes`: the
    node of every rank, for the "inter" records (the ring over all ranks)."""
    nodes = tuple(nodes) if link_class == "inter" and nodes else None
    fits = {}
    for case in CASES:
        rows = [r for r in records if r["case"] == case]
        if not rows:
            continue
        kind, variant = case.split(".")
        design, target = [], []
        for r in rows:
            unit_alpha = _coefficients(kind, variant, r, 1.0, 0.0, nodes)
            unit_bytes = _coefficients(kind, variant, r, 0.0, 1.0, nodes)
            w = fit_weight(r["bytes"])
            design.append([w * unit_alpha / r["seconds"], w * unit_bytes / r["seconds"]])
            target.append(w)
        alpha, beta_inv = nonnegative_fit(np.array(design), np.array(target))
        bandwidth = min(8 / beta_inv / 1e9, MAX_GBPS) if beta_inv > 0 else MAX_GBPS
        fits[case] = AlphaBeta(latency_us=alpha * 1e6, bandwidth_gbps=bandwidth)
    return fits


def fit_weight(nbytes: int) -> float:
    """Weight of a measurement's relative error in the fit: 1 for messages up to 1 MiB,
    growing with the fourth root of the size beyond (1.4 at 4 MiB, 2 at 16 MiB). A shaped link
    passes a burst at line rate, so below a few MiB it looks faster than it is; the large
    messages, which show the sustained bandwidth, must decide beta."""
    return max(1.0, nbytes / 2**20) ** 0.25


MAX_GBPS = 10_000.0  # a latency-bound fit cannot tell bandwidths beyond this apart


def fit_transfer_cpu(rows: Sequence[Sequence[float]]) -> dict[str, float]:
    """{"transfer_cpu_share": gamma, "transfer_cpu_us_per_message": m} fitted to (k, S, lost)
    rows, lost = m k + gamma S (profiling.overlap; one device kind's ranks together)."""
    a = np.array([[k, s] for k, s, _ in rows], dtype=float)
    per_message, share = nonnegative_fit(a, np.array([lost for _, _, lost in rows], dtype=float))
    return {"transfer_cpu_share": min(1.0, share), "transfer_cpu_us_per_message": per_message * 1e6}


def _p2p(fit: dict[str, float]) -> dict[str, float]:
    return {"p2p_cpu_share": fit["transfer_cpu_share"], "p2p_cpu_us_per_message": fit["transfer_cpu_us_per_message"]}


def nonnegative_fit(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Least squares for two non-negative unknowns (the unconstrained solution, or the best
    with one of them at 0)."""
    x, *_ = np.linalg.lstsq(a, b, rcond=None)
    if (x >= 0).all():
        return float(x[0]), float(x[1])
    best = None
    for keep in (0, 1):
        col = a[:, keep]
        v = max(float(col @ b / (col @ col)), 0.0) if col @ col > 0 else 0.0
        sol = (v, 0.0) if keep == 0 else (0.0, v)
        err = float(np.sum((a @ np.array(sol) - b) ** 2))
        if best is None or err < best[0]:
            best = (err, sol)
    return best[1]


def _coefficients(kind: str, variant: str, r: dict, alpha: float, beta_inv: float,
                  nodes: tuple[int, ...] | None) -> float:
    """The cost model's value for one record with the given alpha (s) and 1/beta (s/byte)."""
    a, b = collective_terms(kind, variant, r["group"], alpha, r["bytes"] * beta_inv, r["shares"], nodes)
    return max(x + y * s for x, y, s in zip(a, b, r["shares"]))


def calibration(records: dict[str, list[dict]], nodes: Sequence[int] | None = None) -> Calibration:
    """The fits of every link class's records (`nodes`: the node of every rank)."""
    collectives: dict[str, dict[str, AlphaBeta]] = {}
    for link_class, rows in records.items():
        for case, ab in fit(rows, link_class, nodes).items():
            collectives.setdefault(case, {})[link_class] = ab
    return Calibration(collectives=collectives, source="hetsynth profile")


def measured_spec(cluster: ClusterSpec, compute: Sequence[dict], records: dict[str, list[dict]]) -> ClusterSpec:
    kinds = {}
    for kind, spec in cluster.device_kinds.items():
        rows = [c for c, d in zip(compute, cluster.devices) if d.kind == kind]
        mean = lambda key: statistics.mean(r[key] for r in rows)
        kinds[kind] = spec.model_copy(update={
            "throughput_flops": mean("throughput_flops"), "memory_bandwidth_gbyte_s": mean("memory_bandwidth_gbyte_s"),
            "kernel_launch_us": mean("kernel_launch_us"), "measured": True,
            **({"matmul_flops": measured_rates([r["matmul_flops"] for r in rows])}
               if rows and all("matmul_flops" in r for r in rows) else {}),
            **(fit_transfer_cpu([x for r in rows for x in r["transfer_cpu_rows"]])
               if all("transfer_cpu_rows" in r for r in rows) else {}),
            **(_p2p(fit_transfer_cpu([x for r in rows for x in r["p2p_cpu_rows"]]))
               if all(r.get("p2p_cpu_rows") for r in rows) else {})})
    return cluster.model_copy(update={"device_kinds": kinds,
                                      "calibration": calibration(records, cluster.rank_nodes())})
