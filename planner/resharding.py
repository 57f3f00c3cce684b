"""Choosing how a tensor moves between sub-meshes: four methods, each a schedule of chains
(instruction_set.resharding), all costed per NIC (cost_models.flows); the plan keeps the
cheapest (or the one asked for) and records every alternative's prediction and the NIC bound.

With senders(s) the holders of slice s's source tile and receivers(s) those of its destination
tile; a receiver that is itself a sender copies locally in every method.

  send_recv        one transfer per (slice, receiver), from the least-loaded sender device
                   (bytes sent so far; Alpa's baseline): a slice crosses a NIC once per
                   receiving replica
  local_allgather  on each host with k receivers of a slice, receiver j gets the j-th of k
                   pieces (as send_recv), then the k pieces go round the host in a ring of
                   chains (phase 1): the NIC takes each slice once per host (Alpa)
  broadcast        one pipelined chain per slice from its first sender, the sender's host
                   first, then host by host; all at once
  broadcast_lb     slices with several sender hosts are cut into pieces (q_s = b(s) / quantum,
                   1..16, quantum = Σ b / (4 hosts)) so that the sender hosts can share them;
                   pieces by size, largest first (LPT), each from the sender host that keeps
                   the largest NIC load it touches smallest (out of the sender host, in and
                   out of the forwarding hosts, in of the last), the receiving hosts ordered
                   by their NIC load were they to forward (max of in and out, seconds), the
                   most burdened last (it forwards nothing: a slow host that only receives
                   keeps its NIC's out side free); receivers on a sender's own host
                   get a loopback chain; then the chains go into rounds that share no NIC
                   resource and no rank (first fit, longest chain first), kept unless
                   running every chain at once is predicted faster, shared NICs costed with
                   their contention (cost_models.flows.CONTENTION); with two NIC speeds a
                   round lasts as long as its slowest NIC and running at once wins

A Partial source is reduce-scattered over the source first (ring, `SourceReduction`) along the
destination's first split dim (else the largest dim), by `source_lengths` (even when not given).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

from hetsynth.cost_models.flows import NicModel, chain_seconds, chunk_bytes, host_map, hops, lower_bound, schedule_cost
from hetsynth.instruction_set.resharding import (Box, Chain, ReshardError, ReshardMethod, ReshardPlan,
                                        ReshardSpec, Slice, SourceReduction, Tile, check_chains, check_slices,
                                        full_box, reduced_side, slices, tiles)
from hetsynth.instruction_set.shards import largest_remainder

Builder = Callable[["_Ctx"], list[Chain]]


class _Ctx:
    """What every builder reads: the spec's hosts, tiles, slices and the NIC model."""

    def __init__(self, spec: ReshardSpec, src: tuple[Tile, ...], dst: tuple[Tile, ...],
                 cut: tuple[Slice, ...], nics: NicModel) -> None:
        self.spec, self.src, self.dst, self.cut, self.nics = spec, src, dst, cut, nics
        self.host_of = host_map(spec)

    def senders(self, s: Slice) -> tuple[int, ...]:
        return self.src[s.src_tile].holders

    def remote(self, s: Slice) -> list[int]:
        """Receivers of s that do not hold it already."""
        return [r for r in self.dst[s.dst_tile].holders if r not in self.senders(s)]

    def local(self, i: int, s: Slice) -> list[Chain]:
        """Local copies for receivers that are senders."""
        return [Chain(slice=i, box=s.box, members=(r,), chunk_elems=max(s.box.numel, 1))
                for r in self.dst[s.dst_tile].holders if r in self.senders(s)]

    def chain(self, i: int, box: Box, members: tuple[int, ...], **kw: int) -> Chain:
        nbytes = box.numel * self.spec.itemsize
        c = chunk_bytes(nbytes, members, self.host_of, self.nics)
        return Chain(slice=i, box=box, members=members, chunk_elems=max(c // self.spec.itemsize, 1), **kw)

    def by_host(self, ranks: Sequence[int], first: int | None = None) -> list[list[int]]:
        """Ranks grouped by host, hosts in index order (host `first` first), ranks in order."""
        groups: dict[int, list[int]] = defaultdict(list)
        for r in sorted(ranks):
            groups[self.host_of[r]].append(r)
        return [groups[h] for h in sorted(groups, key=lambda h: (h != first, h))]


def _least_loaded(candidates: Sequence[int], sent: dict[int, int]) -> int:
    return min(candidates, key=lambda q: (sent[q], q))


def send_recv_chains(ctx: _Ctx) -> list[Chain]:
    sent: dict[int, int] = defaultdict(int)
    out = []
    for i, s in enumerate(ctx.cut):
        out += ctx.local(i, s)
        for r in ctx.remote(s):
            p = _least_loaded(ctx.senders(s), sent)
            sent[p] += s.nbytes
            out.append(ctx.chain(i, s.box, (p, r)))
    return out


def local_allgather_chains(ctx: _Ctx) -> list[Chain]:
    sent: dict[int, int] = defaultdict(int)
    out = []
    for i, s in enumerate(ctx.cut):
        out += ctx.local(i, s)
        for group in ctx.by_host(ctx.remote(s)):
            for j, piece in enumerate(s.box.split(len(group))):
                p = _least_loaded(ctx.senders(s), sent)
                sent[p] += piece.numel * ctx.spec.itemsize
                out.append(ctx.chain(i, piece, (p, group[j])))
                if len(group) > 1:
                    ring = tuple(group[j:] + group[:j])
                    out.append(ctx.chain(i, piece, ring, phase=1, order=0))
    return out


def broadcast_chains(ctx: _Ctx) -> list[Chain]:
    out = []
    for i, s in enumerate(ctx.cut):
        out += ctx.local(i, s)
        remote = ctx.remote(s)
        if remote:
            sender = ctx.senders(s)[0]
            groups = ctx.by_host(remote, first=ctx.host_of[sender])
            out.append(ctx.chain(i, s.box, (sender, *[r for g in groups for r in g])))
    return out


def balanced_broadcast_chains(ctx: _Ctx) -> list[Chain]:
    """Pieces, sender hosts by LPT on the NIC loads, rounds sharing no resource."""
    load: dict[tuple[int, str], float] = defaultdict(float)
    sent: dict[int, int] = defaultdict(int)
    out = []
    for i, s, piece in _pieces(ctx):
        out += _balanced_piece(ctx, i, s, piece, load, sent)
    rounds = _rounds(ctx, out)
    cost = {name: schedule_cost(chains, ctx.spec, ctx.nics, 0.0).predicted_s
            for name, chains in (("rounds", rounds), ("concurrent", out))}
    return rounds if cost["rounds"] <= cost["concurrent"] else out


def _pieces(ctx: _Ctx) -> list[tuple[int, Slice, Box]]:
    """(slice index, slice, piece), largest first; local copies are whole slices."""
    hosts = {ctx.host_of[r] for r in ctx.spec.src.ranks + ctx.spec.dst.ranks}
    quantum = max(sum(s.nbytes for s in ctx.cut) / (4 * len(hosts)), 1.0)
    out = []
    for i, s in enumerate(ctx.cut):
        sender_hosts = {ctx.host_of[r] for r in ctx.senders(s)}
        q = min(max(round(s.nbytes / quantum), 1), 16) if len(sender_hosts) > 1 else 1
        out += [(i, s, piece) for piece in s.box.split(q)]
    return sorted(out, key=lambda x: (-x[2].numel, x[0], x[2].start))


def _balanced_piece(ctx: _Ctx, i: int, s: Slice, piece: Box, load: dict, sent: dict) -> list[Chain]:
    """The chains of one piece: local copies, loopback chains beside a sender, and one chain
    from the sender host that keeps the NIC loads it touches smallest to the other hosts."""
    sender_hosts = sorted({ctx.host_of[r] for r in ctx.senders(s)})
    chains = [Chain(slice=i, box=piece, members=(r,), chunk_elems=max(piece.numel, 1))
              for r in ctx.dst[s.dst_tile].holders if r in ctx.senders(s)]
    remote = ctx.remote(s)
    beside = [r for r in remote if ctx.host_of[r] in sender_hosts]
    for group in ctx.by_host(beside):  # receivers beside a sender: over loopback
        chains.append(ctx.chain(i, piece, (_sender_on(ctx, s, ctx.host_of[group[0]], sent), *group)))
    far = ctx.by_host([r for r in remote if r not in beside])
    if not far:
        return chains
    nbytes = piece.numel * ctx.spec.itemsize
    far.sort(key=lambda g: _forward_key(ctx, ctx.host_of[g[0]], nbytes, load))  # the busiest forwards nothing
    g = min(sender_hosts, key=lambda h: (_load_after(ctx, h, far, nbytes, load), load[(h, "out")], h))
    sender = _sender_on(ctx, s, g, sent)
    sent[sender] += nbytes
    chain = ctx.chain(i, piece, (sender, *[r for grp in far for r in grp]))
    for res, _, _ in hops(chain.members, ctx.host_of, ctx.nics):
        for r in res:
            if r[1] != "loop":
                load[r] += nbytes / ctx.nics.nic_bytes_s[r[0]]
    return chains + [chain]


def _forward_key(ctx: _Ctx, h: int, nbytes: int, load: dict) -> tuple[float, float, float, int]:
    """How burdened host h would be as a forwarder of the next `nbytes` (seconds): the larger of
    its NIC's in and out loads after taking them both, then its out load; a faster NIC first on
    a tie. A host whose NIC is saturated coming in (a slow host) goes last and forwards nothing."""
    t = nbytes / ctx.nics.nic_bytes_s[h]
    inn, out = load[(h, "in")] + t, load[(h, "out")] + t
    return max(inn, out), out, -ctx.nics.nic_bytes_s[h], h


def _sender_on(ctx: _Ctx, s: Slice, host: int, sent: dict[int, int]) -> int:
    return _least_loaded([q for q in ctx.senders(s) if ctx.host_of[q] == host], sent)


def _load_after(ctx: _Ctx, g: int, far: list[list[int]], nbytes: int, load: dict) -> float:
    """The largest load (seconds) among the NIC resources a chain from host g through the
    hosts of `far` touches, after adding it: g's out, every host's in, the forwarders' out."""
    bw = ctx.nics.nic_bytes_s
    touched = {(g, "out"): nbytes / bw[g]}
    for k, grp in enumerate(far):
        h = ctx.host_of[grp[0]]
        touched[(h, "in")] = touched.get((h, "in"), 0.0) + nbytes / bw[h]
        if k + 1 < len(far):
            touched[(h, "out")] = touched.get((h, "out"), 0.0) + nbytes / bw[h]
    return max(load[r] + t for r, t in touched.items())


def _rounds(ctx: _Ctx, chains: list[Chain]) -> list[Chain]:
    """First fit into rounds whose chains share no NIC resource and no rank, longest first."""
    timed = sorted(chains, key=lambda c: -chain_seconds(c, ctx.spec.itemsize, ctx.host_of, ctx.nics))
    used: list[set] = []
    out = []
    for chain in timed:
        need = {r for res, _, _ in hops(chain.members, ctx.host_of, ctx.nics) for r in res} | set(chain.members)
        k = next((k for k, u in enumerate(used) if not u & need), len(used))
        if k == len(used):
            used.append(set())
        used[k] |= need
        out.append(chain.model_copy(update={"order": k}))
    return out


BUILDERS: dict[ReshardMethod, Builder] = {
    ReshardMethod.SEND_RECV: send_recv_chains,
    ReshardMethod.LOCAL_ALLGATHER: local_allgather_chains,
    ReshardMethod.BROADCAST: broadcast_chains,
    ReshardMethod.BROADCAST_LB: balanced_broadcast_chains,
}


def plan_reshard(spec: ReshardSpec, nics: NicModel, *, source_lengths: Sequence[int] | None = None,
                 method: ReshardMethod | None = None) -> ReshardPlan:
    """Tiles, slices and every method's schedule, costed; keeps the cheapest or `method`."""
    reduction, reduce_s = _source_reduction(spec, nics, source_lengths)
    src_side = reduced_side(spec.src, reduction.dim, reduction.lengths, spec.shape) if reduction else spec.src
    src, dst = tiles(src_side), tiles(spec.dst)
    cut = slices(src, dst, spec.itemsize)
    check_slices(src, dst, cut)
    ctx = _Ctx(spec.model_copy(update={"src": src_side}), src, dst, cut, nics)
    bound = lower_bound(ctx.spec, src, dst, cut, nics)
    schedules = {m: build(ctx) for m, build in BUILDERS.items()}
    costs = {m: schedule_cost(c, ctx.spec, nics, bound, reduce_s) for m, c in schedules.items()}
    pick = method or min(costs, key=lambda m: (costs[m].predicted_s, list(BUILDERS).index(m)))
    plan = ReshardPlan(spec=spec, source_reduction=reduction, src_tiles=src, dst_tiles=dst, slices=cut,
                       method=pick, chains=tuple(schedules[pick]), predicted_s=costs[pick].predicted_s,
                       lower_bound_s=bound, alternatives=costs)
    check_chains(plan)
    return plan


def _source_reduction(spec: ReshardSpec, nics: NicModel,
                      lengths: Sequence[int] | None) -> tuple[SourceReduction | None, float]:
    """The reduce-scatter of a Partial source and its ring cost (g-1 steps of the largest
    shard over the slowest hop of the ring)."""
    if not spec.src.partial:
        return None, 0.0
    full = full_box(spec.shape)
    split = [d for d in range(len(spec.shape)) if any(b.shape[d] != full.shape[d] for b in spec.dst.boxes)]
    dim = split[0] if split else max(range(len(spec.shape)), key=lambda d: (spec.shape[d], -d)) if spec.shape else 0
    if not spec.shape:
        raise ReshardError(f"tensor {spec.tensor!r}: a Partial 0-d source ({spec.src.describe}) cannot be "
                           f"reduce-scattered; all-reduce it on the source first")
    g = len(spec.src.ranks)
    lengths = tuple(lengths) if lengths is not None else tuple(largest_remainder([1.0] * g, spec.shape[dim]))
    if len(lengths) != g or sum(lengths) != spec.shape[dim] or min(lengths) < 0:
        raise ReshardError(f"tensor {spec.tensor!r}: source reduction lengths {list(lengths)} must be {g} "
                           f"lengths >= 0 adding up to dim {dim} ({spec.shape[dim]})")
    ring = [(a, b) for a, b in zip(spec.src.ranks, spec.src.ranks[1:] + spec.src.ranks[:1])]
    host_of = dict(zip(spec.src.ranks, spec.src.hosts))
    step_bytes = max(lengths) * full.numel // max(spec.shape[dim], 1) * spec.itemsize
    worst = max((alpha + step_bytes / bw for pair in ring for _, alpha, bw in hops(pair, host_of, nics)),
                default=0.0)
    return SourceReduction(dim=dim, lengths=lengths), (g - 1) * worst
