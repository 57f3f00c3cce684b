"""Cost of a resharding schedule on per-host NICs (alpha-beta per NIC), and its lower bound.

Every host h has one NIC of bandwidth bw_h bytes/s (the node's `nic_bandwidth_gbps`, else the
spec's inter-node bandwidth), full duplex: resources (h, out) and (h, in) each carry bw_h.
Ranks of one host talk over the intra-node link, resource (h, loop). A hop a -> b of a chain
(instruction_set.resharding.Chain) uses (host a, out) and (host b, in) between hosts, else
(host, loop); its time for c bytes is alpha + c / min(bw) of the resources it uses.

A pipelined chain of n members moving b bytes in chunks of c bytes (Thakur et al., IJHPCA
2005; the pipelined broadcast):

    T_chain(c) = Σ_hops (alpha_h + c / bw_h) + (ceil(b / c) - 1) max_hops (alpha_h + c / bw_h)
    c*         = sqrt(b alpha / Σ_hops 1 / bw_h), clamped to [64 KiB, 8 MiB]
                 (one message, c = b, for a chain of 2; a chain of 1 is a local copy, b / copy_bw)

A schedule runs its rounds (chains of one (phase, order)) one after the other; inside a round
every chain runs at once and each resource is shared in proportion to the bytes the chains put
on it: chain k gets bw_k(res) = bw(res) b_k / bytes(res) of every resource it crosses, and its
pipeline steps at those shares (a chain is as fast as its slowest share, and it fills and
drains at the shares of every NIC on it, in and out, a forwarding host's included):

    T_chain,shared = Σ_hops (alpha_h + c / bw_k,h) + (ceil(b / c) - 1) max_hops (alpha_h + c / bw_k,h)
                     (bw_k,h: the least share of the hop's resources)
    T_round = max( max_resources bytes(res) / bw(res), max_chains T_chain,shared )
    T       = Σ_rounds T_round

The steady-state term of T_chain,shared equals its bottleneck resource's load; the fill term
is what tells two chains apart that cross the same saturated NIC in a different place: one
that forwards through a slow host pays that host's share twice, in and out.

Sharing is not perfect: TCP flows that share a NIC do not add up to its line rate (unequal
shares, losses at the shaper, a round ending with its slowest flow). A round in which two or
more chains cross one NIC resource costs (1 + CONTENTION) T_round; a round whose chains share
no NIC is costed as above. CONTENTION = 0.1 is calibrated on the emulated cluster (tbf-shaped
500 Mbit/s NICs, bench/resharding.py cases, 32 MiB, medians of 4, one run): the same chains of
broadcast_lb run at once vs in rounds that share no NIC measured 1.27x (case4, 64 transfers),
1.25x (case2), 1.17x (case7), 1.03x (case3), 1.02x (case8) slower at once; 0.1 keeps the
rounds wherever the perfect-sharing model put them within 10 % of running at once.

Lower bound (reported beside every prediction): every host that holds a receiver of a slice
but no sender must take the slice in once; the bytes that leave the sender hosts are split
among them at best fractionally:

    in_h  = Σ_{slices s: h holds a receiver of s and no sender} b(s)
    out*  = min over x_{s,g} >= 0, Σ_g x_{s,g} = b(s) (g: the sender hosts of s; slices with
            some receiving host that holds no sender) of max_g Σ_s x_{s,g} / bw_g
    LB    = max( max_h in_h / bw_h, out* )

out* by bisection on the time T: feasible iff the maximum flow from the slices (capacity b(s))
through their sender hosts to a sink (capacity T bw_g) carries every byte (networkx).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

import networkx as nx

from hetsynth.instruction_set.cluster import ClusterSpec
from hetsynth.instruction_set.resharding import Chain, MethodCost, ReshardSpec, Slice, Tile

MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 64 * 1024, 8 * 1024 * 1024
CONTENTION = 0.1  # extra time of a round whose chains share a NIC (module docstring)
Resource = tuple[int, str]  # (host, "out" | "in" | "loop")


@dataclass(frozen=True)
class NicModel:
    """Per-host NIC and intra-host bandwidths (bytes/s) and latencies (s)."""

    nic_bytes_s: tuple[float, ...]
    loop_bytes_s: tuple[float, ...]
    alpha_s: float
    loop_alpha_s: float
    copy_bytes_s: float = 5e9

    @staticmethod
    def from_cluster(spec: ClusterSpec) -> "NicModel":
        links = spec.links
        nic = tuple((n.nic_bandwidth_gbps or links.inter_node_bandwidth_gbps) * 1e9 / 8 for n in spec.nodes)
        loop = tuple((n.intra_bandwidth_gbps or links.intra_node_bandwidth_gbps) * 1e9 / 8 for n in spec.nodes)
        return NicModel(nic, loop, links.inter_node_latency_us * 1e-6, links.intra_node_latency_us * 1e-6)

    def capacity(self, res: Resource) -> float:
        host, kind = res
        return self.loop_bytes_s[host] if kind == "loop" else self.nic_bytes_s[host]


def hops(members: Sequence[int], host_of: dict[int, int], nics: NicModel) -> list[tuple[tuple[Resource, ...], float, float]]:
    """(resources, alpha_s, bytes/s) of every hop of a chain."""
    out = []
    for a, b in zip(members, members[1:]):
        ha, hb = host_of[a], host_of[b]
        res: tuple[Resource, ...] = ((ha, "out"), (hb, "in")) if ha != hb else ((ha, "loop"),)
        alpha = nics.alpha_s if ha != hb else nics.loop_alpha_s
        out.append((res, alpha, min(nics.capacity(r) for r in res)))
    return out


def chunk_bytes(nbytes: int, members: Sequence[int], host_of: dict[int, int], nics: NicModel) -> int:
    """The chunk size c* that minimises T_chain (whole message for a chain of 2 or less)."""
    path = hops(members, host_of, nics)
    if len(path) <= 1:
        return max(nbytes, 1)
    alpha = max(path, key=lambda h: h[1] + MIN_CHUNK_BYTES / h[2])[1]
    c = math.sqrt(nbytes * alpha / sum(1 / bw for _, _, bw in path))
    return int(min(max(c, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES, max(nbytes, 1)))


def chain_seconds(chain: Chain, itemsize: int, host_of: dict[int, int], nics: NicModel,
                  load: dict[Resource, float] | None = None) -> float:
    """T_chain with its recorded chunk size: alone, or at its byte share of every resource
    when `load` (bytes per resource of the round it runs in) is given."""
    nbytes = chain.box.numel * itemsize
    path = hops(chain.members, host_of, nics)
    if not path:
        return nbytes / nics.copy_bytes_s
    c = min(chain.chunk_elems * itemsize, nbytes) if nbytes else 0
    steps = [alpha + c / _share(res, bw, nbytes, load, nics) for res, alpha, bw in path]
    return sum(steps) + (math.ceil(nbytes / c) - 1 if c else 0) * max(steps)


def _share(res: tuple[Resource, ...], bw: float, nbytes: int, load: dict[Resource, float] | None,
           nics: NicModel) -> float:
    """The bytes/s a chain moving `nbytes` gets on a hop: the least of its byte-proportional
    shares of the hop's resources (the hop's own bandwidth when alone)."""
    if load is None or nbytes == 0:
        return bw
    return min(nics.capacity(r) * nbytes / max(load[r], nbytes) for r in res)


def round_seconds(chains: Iterable[Chain], itemsize: int, host_of: dict[int, int], nics: NicModel) -> float:
    """T_round: the busiest resource, or the slowest chain at its shares (module docstring)."""
    chains = list(chains)
    load: dict[Resource, float] = defaultdict(float)
    for chain in chains:
        for res, _, _ in hops(chain.members, host_of, nics):
            for r in res:
                load[r] += chain.box.numel * itemsize
    slowest = max((chain_seconds(chain, itemsize, host_of, nics, load) for chain in chains), default=0.0)
    ideal = max([slowest] + [b / nics.capacity(r) for r, b in load.items()])
    return ideal * (1 + CONTENTION) if _shares_nic(chains, host_of, nics) else ideal


def _shares_nic(chains: list[Chain], host_of: dict[int, int], nics: NicModel) -> bool:
    """Whether two chains of a round cross one NIC resource (a host's out or in)."""
    seen: set[Resource] = set()
    for chain in chains:
        mine = {r for res, _, _ in hops(chain.members, host_of, nics) for r in res if r[1] != "loop"}
        if mine & seen:
            return True
        seen |= mine
    return False


def schedule_cost(chains: Sequence[Chain], spec: ReshardSpec, nics: NicModel, lower_bound_s: float,
                  extra_s: float = 0.0) -> MethodCost:
    """Σ over rounds (phase, order) of T_round, plus `extra_s` (a source reduction)."""
    host_of = host_map(spec)
    rounds: dict[tuple[int, int], list[Chain]] = defaultdict(list)
    for chain in chains:
        rounds[chain.key].append(chain)
    total = sum(round_seconds(cs, spec.itemsize, host_of, nics) for cs in rounds.values())
    return MethodCost(predicted_s=total + extra_s, lower_bound_s=lower_bound_s, num_rounds=len(rounds))


def host_map(spec: ReshardSpec) -> dict[int, int]:
    return dict(zip(spec.src.ranks + spec.dst.ranks, spec.src.hosts + spec.dst.hosts))


def lower_bound(spec: ReshardSpec, src: Sequence[Tile], dst: Sequence[Tile], cut: Sequence[Slice],
                nics: NicModel) -> float:
    """LB = max(max_h in_h / bw_h, out*) (module docstring)."""
    host_of = host_map(spec)
    into: dict[int, int] = defaultdict(int)
    outgoing: list[tuple[int, set[int]]] = []
    for s in cut:
        senders = {host_of[r] for r in src[s.src_tile].holders}
        remote = {host_of[r] for r in dst[s.dst_tile].holders} - senders
        for h in remote:
            into[h] += s.nbytes
        if remote:
            outgoing.append((s.nbytes, senders))
    bound_in = max([b / nics.nic_bytes_s[h] for h, b in into.items()] + [0.0])
    return max(bound_in, _min_max_out(outgoing, nics))


def _min_max_out(outgoing: list[tuple[int, set[int]]], nics: NicModel, iterations: int = 50) -> float:
    """out*: the least T at which the sender hosts can emit every slice's bytes (bisection)."""
    total = sum(b for b, _ in outgoing)
    if total == 0:
        return 0.0
    lo, hi = 0.0, max(total / nics.nic_bytes_s[h] for _, hs in outgoing for h in hs)
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _feasible(outgoing, nics, mid, total) else (mid, hi)
    return hi


def _feasible(outgoing: list[tuple[int, set[int]]], nics: NicModel, seconds: float, total: int) -> bool:
    g = nx.DiGraph()
    for i, (nbytes, hosts) in enumerate(outgoing):
        g.add_edge("src", ("s", i), capacity=nbytes)
        for h in hosts:
            g.add_edge(("s", i), ("h", h))
            g.add_edge(("h", h), "sink", capacity=seconds * nics.nic_bytes_s[h])
    return nx.maximum_flow_value(g, "src", "sink") >= total * (1 - 1e-9)
