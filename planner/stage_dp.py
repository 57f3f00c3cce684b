"""The stage choice: number of stages, cuts at block starts and sub-meshes, by dynamic programming.

Alpa-style inter-operator DP over stage cuts (not a MILP). The model is cut into segments at
block starts (`block_starts`, coarsened to at most `max_segments`); the cluster into units
(whole nodes, halved while there are fewer than `min_units`), taken in order. A stage is a
contiguous run of segments on a contiguous run of units; every unit is used.

Per stage s (segments G on units D, micro-batch size b of batch B), a roofline estimate:

    t_s    = (b / B) * sum_{g in G} flops_g / sum_{d in D} throughput_d          (F + B, per micro-batch)
    sync_s = 2 (|D| - 1) / |D| * params_G / bandwidth(D)                         (per step)
    mem_d  = copies * params_G + n_s * (b / B) * saved_G * share_d <= memory_d   (every d in D)

with share_d = throughput_d / sum throughput (the ratio LP's data split), `copies` the
optimizer's state copies, saved_G the bytes the segments save for backward (the measured
saved-tensor model, `Node.saved`), and n_s the micro-batches in flight on stage s (`in_flight`).
The ranking objective of (stages, M, schedule) is

    T = sum_s (t_s + sync_s) + (M - 1) max_s t_s

For each candidate t_max the DP over (segment, unit, stages left) minimises sum_s (t_s +
sync_s) subject to t_s <= t_max and memory; T = that sum + (M - 1) t_max, minimised over t_max
(`solve`: exact while the window of t_max that can still win holds at most `max_candidates`
distinct stage times, else those spread evenly over it). In-flight counts depend on the
stages after a stage, so the DP runs from the last stage. The estimate ranks; the chosen
candidates are then synthesized for real (planner.pipeline) and predicted by the schedule
simulation.

Written here: no library does inter-operator DP over a heterogeneous cluster's sub-meshes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hetsynth.instruction_set.cluster import ClusterSpec
from hetsynth.instruction_set.graph import ReferenceGraph
from hetsynth.instruction_set.plan import PLANNED_OPTIMIZER, STATE_COPIES, Plan
from hetsynth.instruction_set.schedule import Schedule

INF = float("inf")


def in_flight(schedule: Schedule, num_stages: int, stage: int, num_micro: int) -> int:
    """Micro-batches whose activations stage `stage` (0-based of S) holds at once: GPipe all M,
    1F1B min(M, S - s), eager-1F1B min(M, 2 (S - s) - 1)."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage}: choose 0..{num_stages - 1}")
    left = num_stages - stage
    n = {Schedule.GPIPE: num_micro, Schedule.ONE_F_ONE_B: left, Schedule.EAGER_1F1B: 2 * left - 1}[schedule]
    return min(num_micro, n)


@dataclass(frozen=True)
class Segments:
    """Per segment (a run of calls between two cut points): FLOPs (forward + backward),
    parameter bytes and saved-for-backward bytes at the full batch."""
    bounds: tuple[int, ...]   # call indices: segment g is calls [bounds[g], bounds[g + 1])
    flops: np.ndarray
    params: np.ndarray
    saved: np.ndarray


def segments(graph: ReferenceGraph, starts: Sequence[int], max_segments: int = 24) -> Segments:
    """The segments between `starts` (block starts), every k-th kept so there are at most
    `max_segments`; each parameter counted at its first consumer."""
    k = max(1, -(-(len(starts) + 1) // max_segments))
    bounds = (0, *starts[k - 1::k], len(graph.calls))
    bounds = tuple(sorted(set(bounds)))
    seen: set[str] = set()
    flops, params, saved = [], [], []
    for a, b in zip(bounds, bounds[1:]):
        f = p = s = 0.0
        for node in graph.calls[a:b]:
            f += node.flops_fwd + node.flops_bwd
            s += sum(t.nbytes for t in node.saved) if node.saved is not None else node.out_bytes
            for name in node.inputs:
                if name not in seen and graph.node(name).op == "param":
                    seen.add(name)
                    p += graph.node(name).out_bytes
        flops.append(f), params.append(p), saved.append(s)
    return Segments(bounds, np.array(flops), np.array(params), np.array(saved))


def units(cluster: ClusterSpec, min_units: int = 8) -> list[range]:
    """Contiguous rank ranges: whole nodes, each halved (while its size is even) until there
    are at least `min_units` or every unit is one device."""
    sizes = [len(n.devices) for n in cluster.nodes]
    while len(sizes) < min(min_units, cluster.num_devices) and any(s % 2 == 0 for s in sizes):
        sizes = [h for s in sizes for h in ((s // 2, s // 2) if s % 2 == 0 else (s,))]
    starts = np.cumsum([0, *sizes])
    return [range(int(a), int(b)) for a, b in zip(starts, starts[1:])]


@dataclass(frozen=True)
class StageTable:
    """Every possible stage [j, j') x [i, i'): time per full batch, sync per step, and the
    memory check's terms (arrays indexed [j, j', i, i'])."""
    time: np.ndarray      # seconds for the whole batch's F + B (scale by b / B)
    sync: np.ndarray
    params: np.ndarray    # copies * params bytes (per device)
    memory: np.ndarray    # [K, ...]: per unit range, its distinct (memory bytes, ...
    share: np.ndarray     # ... share of the batch) pairs, padded with (inf, 0)
    saved: np.ndarray     # saved bytes at the full batch


def stage_table(seg: Segments, cluster: ClusterSpec, groups: Sequence[range]) -> StageTable:
    U = len(groups)
    speed, mem = np.array(cluster.throughputs_flops()), np.array(cluster.memories_gib()) * 2 ** 30
    fl, pa, sv = (np.concatenate([[0.0], np.cumsum(x)]) for x in (seg.flops, seg.params, seg.saved))
    span = lambda x: x[None, :] - x[:, None]  # noqa: E731  [j, j'] -> sum over [j, j')
    flops, params, saved = span(fl), span(pa), span(sv)
    thr, bw = np.full((U + 1, U + 1), np.nan), np.full((U + 1, U + 1), np.nan)
    K = len(cluster.device_kinds)
    free, share = np.full((K, U + 1, U + 1), INF), np.zeros((K, U + 1, U + 1))
    for i in range(U):
        for k in range(i + 1, U + 1):
            ranks = range(groups[i].start, groups[k - 1].stop)
            s = speed[ranks.start:ranks.stop]
            thr[i, k] = s.sum()
            nodes = {cluster.node_of(r) for r in ranks}
            links = cluster.links
            gbps = links.inter_node_bandwidth_gbps if len(nodes) > 1 else links.intra_node_bandwidth_gbps
            n = len(ranks)
            bw[i, k] = gbps * 1e9 / 8 / (2 * (n - 1) / n) if n > 1 else INF
            m, sh = mem[ranks.start:ranks.stop], s / s.sum()
            for x, (mx, shx) in enumerate(sorted(set(zip(m, sh)))):  # one pair per device kind
                free[x, i, k], share[x, i, k] = mx, shx
    copies = STATE_COPIES[PLANNED_OPTIMIZER]
    time = flops[:, :, None, None] / thr[None, None]
    sync = params[:, :, None, None] / bw[None, None]
    return StageTable(time, sync, copies * params[:, :, None, None], free[:, None, None],
                      share[:, None, None], saved[:, :, None, None])


def fits(table: StageTable, n: int, frac: float) -> np.ndarray:
    """Stages whose devices hold the parameter state and n micro-batches of frac of the batch
    (every distinct (memory, share) pair of the stage's devices checked)."""
    need = table.params[None] + n * frac * table.saved[None] * table.share
    return np.all(need <= table.memory, axis=0)


@dataclass(frozen=True)
class StageCandidate:
    estimate_s: float
    num_micro: int
    schedule: Schedule
    stages: tuple[tuple[range, tuple[int, int]], ...]   # (ranks, calls [start, stop))

    def describe(self) -> str:
        parts = "; ".join(f"ranks {r.start}-{r.stop - 1} calls {a}-{b - 1}" for r, (a, b) in self.stages)
        return f"{len(self.stages)} stages, M={self.num_micro}, {self.schedule.value}, estimate {self.estimate_s:.4g} s: {parts}"


def _valid(J: int, U: int) -> np.ndarray:
    j = np.arange(J + 1)
    i = np.arange(U + 1)
    return (j[:, None] < j[None, :])[:, :, None, None] & (i[:, None] < i[None, :])[None, None]


def solve(table: StageTable, num_stages: int, num_micro: int, schedule: Schedule, batch: int,
          micro: int, max_candidates: int = 64) -> tuple[float, list[tuple[int, int, int, int]]] | None:
    """The best (T, stages as (j, j', i, i')) for S stages, M micro-batches of size `micro`
    (module docstring), or None when nothing fits.

    Feasibility is monotone in t_max, so the smallest feasible t_max (t_lo) is found by
    bisection over the distinct stage times. With sum_lb the unconstrained minimum sum, a
    t_max can only win while (M - 1) t_max + sum_lb < T(t_lo): the candidates are that window
    (spread evenly over it when it holds more than `max_candidates`)."""
    J, U = table.time.shape[0] - 1, table.time.shape[2] - 1
    frac = micro / batch
    t = np.where(_valid(J, U), table.time * frac, INF)
    masks = [fits(table, in_flight(schedule, num_stages, s, num_micro), frac) for s in range(num_stages)]
    cost = t + np.nan_to_num(table.sync, nan=INF, posinf=0.0)
    values = np.unique(t[np.isfinite(t) & np.any(masks, axis=0)])
    run = lambda t_max: _dp(np.where(t <= t_max, cost, INF), masks, num_stages, J, U)  # noqa: E731
    if not len(values) or run(values[-1]) is None:
        return None
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if run(values[mid]) is not None else (mid + 1, hi)
    first = run(values[lo])
    best = (first[0] + (num_micro - 1) * values[lo], first[1])
    sum_lb = run(INF)[0]
    window = values[lo + 1:][(num_micro - 1) * values[lo + 1:] + sum_lb < best[0]]
    for t_max in _spread(window, max_candidates):
        if (num_micro - 1) * t_max + sum_lb >= best[0]:
            break
        got = run(t_max)
        if got[0] + (num_micro - 1) * t_max < best[0]:
            best = (got[0] + (num_micro - 1) * t_max, got[1])
    return best


def _spread(values: np.ndarray, cap: int) -> list[float]:
    if len(values) <= cap:
        return list(values)
    picks = np.unique(np.linspace(0, len(values) - 1, cap).round().astype(int))
    return list(values[picks])


def _dp(cost: np.ndarray, masks: Sequence[np.ndarray], S: int, J: int, U: int):
    """min sum of cost over S stages covering segments 0..J and units 0..U, stage s feasible
    under masks[s]; from the last stage (index S - 1) backwards."""
    value = np.full((J + 1, U + 1), INF)
    value[J, U] = 0.0
    choice = []
    for s in reversed(range(S)):
        c = np.where(masks[s], cost, INF) + value[None, :, None, :]     # [j, j', i, i']
        flat = c.transpose(0, 2, 1, 3).reshape(J + 1, U + 1, -1)
        arg = flat.argmin(axis=2)
        value = np.take_along_axis(flat, arg[..., None], axis=2)[..., 0]
        choice.append(arg)
    if not np.isfinite(value[0, 0]):
        return None
    stages, j, i = [], 0, 0
    for arg in reversed(choice):
        nj, ni = divmod(int(arg[j, i]), U + 1)
        stages.append((j, nj, i, ni))
        j, i = nj, ni
    return float(value[0, 0]), stages


def choose_stages(graph: ReferenceGraph, cluster: ClusterSpec, starts: Sequence[int], *, batch: int,
                  max_stages: int = 8, schedules: Sequence[Schedule] = tuple(Schedule), top_k: int = 2,
                  num_micro: int | None = None) -> list[StageCandidate]:
    """The `top_k` candidates with 2..max_stages stages by the estimate T (module docstring),
    over M in {S, 2S, 4S, 8S} within the batch and the given schedules; [] when none fits."""
    seg = segments(graph, starts)
    groups = units(cluster)
    table = stage_table(seg, cluster, groups)
    found: list[StageCandidate] = []
    for S in range(2, min(max_stages, len(seg.flops), len(groups)) + 1):
        for M in [num_micro] if num_micro else sorted({m for m in (S, 2 * S, 4 * S, 8 * S) if m <= batch}):
            for sched in schedules:
                got = solve(table, S, M, sched, batch, -(-batch // M))
                if got is not None:
                    found.append(StageCandidate(got[0], M, sched, tuple(
                        (range(groups[i].start, groups[k - 1].stop), (seg.bounds[j], seg.bounds[jj]))
                        for j, jj, i, k in got[1])))
    found.sort(key=lambda c: c.estimate_s)
    out: list[StageCandidate] = []
    for c in found:  # distinct stage choices only
        if all(c.stages != o.stages for o in out):
            out.append(c)
    return out[:top_k]


def stage_memory(plan: Plan) -> list[tuple[float, float, int]]:
    """Per stage: (peak GiB, capacity GiB, micro-batches in flight) of its fullest device under
    the plan's schedule: the stage plan's memory at the largest micro-batch plus the
    saved-for-backward bytes of the other micro-batches in flight (planner.stage_dp.in_flight)."""
    p = plan.pipeline
    out = []
    for st in p.stages:
        n = in_flight(p.schedule, len(p.stages), st.index, len(p.micro_batches))
        devs = st.plans[max(st.plans)].predicted.devices
        peak = [(d.memory_gib + (n - 1) * (d.saved_gib or 0.0), d.memory_capacity_gib) for d in devs]
        worst = max(peak, key=lambda x: x[0] / x[1])
        out.append((worst[0], worst[1], n))
    return out
