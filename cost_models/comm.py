"""Communication cost: alpha-beta per collective kind and implementation variant.

A message of b bytes over a link costs `alpha + b / beta` (Hockney). For a group of n
devices the ring's bottleneck link sets beta (the inter-node NIC when the group spans nodes,
else the intra-node link) and alpha is that link's latency; a profiled `Calibration` replaces
both per variant and link class. With D the bytes of the full tensor and s_i device i's
share of the sharded dim (so the largest shard is max_i s_i * D):

  all_gather / reduce_scatter
    padded   (n-1) * (alpha + max_i s_i * D / beta)   pad to the largest shard, one ring
    ring     (n-1) * alpha + (1 - min_i s_i) * D / beta  point-to-point ring, exact sizes;
             every link carries all shards but its receiver's own
    grouped  n * alpha + D / beta                      one (pipelined) broadcast / reduce per
             root, no padding (Thakur et al., IJHPCA 2005; uneven: HAP, EuroSys'24)
  all_reduce
    ring     2 (n-1) alpha + 2 (n-1)/n * D / beta      (Patarasuk & Yuan, 2009)
    hierarchical  on N nodes of t devices each: reduce-scatter inside each node, t concurrent
             all-reduces of D/t across nodes sharing each node's NIC, all-gather inside:
             2 (t-1) alpha_i + 2 (N-1) alpha_e + 2 (t-1)/t D / beta_i + 2 (N-1)/N D / beta_e
             (BlueConnect, Cho et al., SysML 2019); a NIC carries 2 (N-1)/N D instead of the
             flat ring's 2 (n-1)/n D
  all_to_all   (n-1) alpha + max_i s_i * D / beta      a rank sends at most its own shard
  slice (R -> S), partial (R -> P): local, free.

Each is a LinearCost in the shares (cost_models.linear_cost). The backward of a collective
is its adjoint (all_gather <-> reduce_scatter, all_reduce <-> all_reduce, all_to_all <->
all_to_all, slice <-> zero-padding), charged with the same variant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cost_models.calibration import AlphaBeta
from cost_models.cluster import ClusterSpec
from cost_models.linear_cost import LinearCost

VARIANTS: dict[str, tuple[str, ...]] = {
    "all_gather": ("padded", "grouped", "ring"),
    "reduce_scatter": ("padded", "grouped", "ring"),
    "all_reduce": ("ring", "hierarchical"),
    "all_reduce_max": ("ring",),
    "all_to_all": ("native",),
    "slice": ("local",),
    "partial": ("local",),
}

ADJOINT: dict[str, str | None] = {
    "all_gather": "reduce_scatter",
    "reduce_scatter": "all_gather",
    "all_reduce": "all_reduce",
    "all_to_all": "all_to_all",
    "slice": None,            # backward zero-pads: local
    "partial": None,          # backward masks: local
    "all_reduce_max": None,   # only for tensors without gradient
}

LOCAL = frozenset({"slice", "partial"})

GRAD_BUCKET_BYTES = 25 * 2**20  # gradient all-reduce bucket (DDP's default bucket_cap_mb)


@dataclass(frozen=True)
class CommModel:
    """Link parameters of the group of all devices of a cluster."""

    cluster: ClusterSpec
    _alpha_beta: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict, repr=False)

    @property
    def n(self) -> int:
        return self.cluster.num_devices

    @property
    def link_class(self) -> str:
        return "inter" if len(self.cluster.nodes) > 1 else "intra"

    def link(self) -> AlphaBeta:
        """The ring's bottleneck link from the spec."""
        spec, links = self.cluster, self.cluster.links
        intra = [n.intra_bandwidth_gbps or links.intra_node_bandwidth_gbps
                 for n in spec.nodes if len(n.devices) > 1]
        if len(spec.nodes) == 1:
            return AlphaBeta(latency_us=links.intra_node_latency_us, bandwidth_gbps=min(intra or [1e9]))
        nics = [n.nic_bandwidth_gbps or links.inter_node_bandwidth_gbps for n in spec.nodes]
        return AlphaBeta(latency_us=max(links.inter_node_latency_us, links.intra_node_latency_us),
                         bandwidth_gbps=min(nics + intra))

    def alpha_beta(self, kind: str, variant: str) -> tuple[float, float]:
        """(alpha seconds, beta bytes/second) for a variant: calibrated, else the spec's link."""
        key = (kind, variant)
        if key not in self._alpha_beta:
            cal = self.cluster.calibration
            fit = cal.lookup(f"{kind}.{variant}", self.link_class) if cal else None
            ab = fit or self.link()
            self._alpha_beta[key] = (ab.latency_us * 1e-6, ab.bandwidth_gbps * 1e9 / 8)
        return self._alpha_beta[key]

    def cost(self, kind: str, variant: str, nbytes: float) -> LinearCost:
        """Forward cost of one collective on a tensor of `nbytes` (full size)."""
        n = self.n
        if n == 1 or kind in LOCAL:
            return LinearCost.zero(n)
        alpha, beta = self.alpha_beta(kind, variant)
        d = nbytes / beta
        if kind in ("all_gather", "reduce_scatter"):
            if variant == "padded":
                return LinearCost(((n - 1) * alpha,) * n, ((n - 1) * d,) * n)
            if variant == "ring":
                return LinearCost(((n - 1) * alpha + d,) * n, (-d,) * n)
            if variant == "grouped":
                return LinearCost.constant(n * alpha + d, n)
        if kind == "all_reduce" and variant == "hierarchical":
            return LinearCost.constant(self._hierarchical_allreduce(nbytes), n)
        if kind in ("all_reduce", "all_reduce_max"):
            return LinearCost.constant(2 * (n - 1) * alpha + 2 * (n - 1) / n * d, n)
        if kind == "all_to_all":
            return LinearCost(((n - 1) * alpha,) * n, (d,) * n)
        raise ValueError(f"unknown collective {kind}.{variant}")

    @property
    def hierarchical(self) -> bool:
        """Whether a two-level all-reduce applies: several nodes of equal size > 1."""
        sizes = {len(n.devices) for n in self.cluster.nodes}
        return len(self.cluster.nodes) > 1 and len(sizes) == 1 and sizes.pop() > 1

    def _hierarchical_allreduce(self, nbytes: float) -> float:
        if not self.hierarchical:
            return float("inf")
        spec, links = self.cluster, self.cluster.links
        nodes, t = len(spec.nodes), len(spec.nodes[0].devices)
        cal = spec.calibration
        inter = (cal.lookup("all_reduce.hierarchical", "inter") if cal else None) or self.link()
        beta_i = min(n.intra_bandwidth_gbps or links.intra_node_bandwidth_gbps for n in spec.nodes) * 1e9 / 8
        beta_e, alpha_e = inter.bandwidth_gbps * 1e9 / 8, inter.latency_us * 1e-6
        alpha_i = links.intra_node_latency_us * 1e-6
        return (2 * (t - 1) * alpha_i + 2 * (nodes - 1) * alpha_e
                + 2 * (t - 1) / t * nbytes / beta_i + 2 * (nodes - 1) / nodes * nbytes / beta_e)

    def gradient_allreduce(self, nbytes: float) -> LinearCost:
        """Gradient all-reduce of a replicated parameter, bucketed as in DDP (Li et al., VLDB
        2020): parameters share all-reduces of GRAD_BUCKET_BYTES, so one parameter pays the
        bandwidth term of its bytes and its bytes' fraction of a bucket's latency term."""
        n = self.n
        if n == 1:
            return LinearCost.zero(n)
        return min((self.bucketed(v, nbytes) for v in VARIANTS["all_reduce"]), key=lambda c: c.a[0])

    def bucketed(self, variant: str, nbytes: float) -> LinearCost:
        """A variant's cost for `nbytes` inside a GRAD_BUCKET_BYTES bucket: latency pro rata."""
        fraction = min(1.0, nbytes / GRAD_BUCKET_BYTES)
        whole = self.cost("all_reduce", variant, GRAD_BUCKET_BYTES if fraction < 1 else nbytes).a[0]
        empty = self.cost("all_reduce", variant, 0.0).a[0]
        per_byte = (whole - empty) / (GRAD_BUCKET_BYTES if fraction < 1 else max(nbytes, 1.0))
        return LinearCost.constant(empty * fraction + per_byte * nbytes, self.n)

    def with_adjoint(self, kind: str, variant: str, nbytes: float, grad: bool) -> LinearCost:
        """Forward cost plus, when a gradient flows, the adjoint collective's cost."""
        cost = self.cost(kind, variant, nbytes)
        back = ADJOINT.get(kind)
        if grad and back is not None:
            cost = cost + self.cost(back, variant if variant in VARIANTS[back] else VARIANTS[back][0], nbytes)
        return cost
