"""Communication cost: alpha-beta per collective kind, implementation variant and mesh axis.

A message of b bytes over a link costs `alpha + b / beta` (Hockney). A collective runs on a
group of g devices along one axis of the mesh (instruction_set.mesh):

  all     every device; the ring's bottleneck link sets beta (a node's NIC when the group
          spans nodes, else the intra-node link)
  inner   the devices of one node, every node at once; the intra-node link
  outer   one device per node, every local index at once: the per_node concurrent groups
          share each node's NIC, so beta is the NIC's bandwidth / per_node (or the profiled
          "outer" fit, measured with all those groups at once)

A profiled `Calibration` replaces alpha and beta per variant and link class. With D the bytes
of the (per group) tensor and s_i device i's share of the split dim within its group:

  all_gather / reduce_scatter
    padded   (g-1) * (alpha + max_i s_i * D / beta)   pad to the largest shard, one ring
    ring     point-to-point ring, exact sizes, g-1 steps, in every step each member sends
             the shard it received last, so every shard is in flight in every step:
             on equal links (one node, or the inner / outer axis) each step waits for the
             largest shard:  (g-1) * (alpha + max_i s_i * D / beta);
             across nodes the few slow cross-node links dominate, each carrying every shard
             but its receiver's own:  (g-1) * alpha + (1 - min_i s_i) * D / beta_nic
             (a lower bound when one big shard crosses two slow links)
    grouped  g * alpha + D / beta                      one (pipelined) broadcast / reduce per
             root, no padding (Thakur et al., IJHPCA 2005; uneven: HAP, EuroSys'24)
  all_reduce
    ring     2 (g-1) alpha + 2 (g-1)/g * D / beta      (Patarasuk & Yuan, 2009)
    hierarchical  (axis all) on N nodes of t devices: reduce-scatter inside each node, t
             concurrent all-reduces of D/t across nodes sharing each NIC, all-gather inside:
             2 (t-1) alpha_i + 2 (N-1) alpha_e + 2 (t-1)/t D / beta_i + 2 (N-1)/N D / beta_e
             (BlueConnect, Cho et al., SysML 2019)
  all_to_all   (g-1) alpha + max_i s_i * D / beta      a device sends at most its own shard
  slice (R -> S), partial (R -> P): local, free.

Each is a LinearCost in the shares (cost_models.linear_cost) with one entry per device of the
cluster. The backward of a collective is its adjoint (all_gather <-> reduce_scatter,
all_reduce <-> all_reduce, all_to_all <-> all_to_all, slice <-> zero-padding), charged with
the same variant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from cost_models.calibration import AlphaBeta
from cost_models.cluster import ClusterSpec
from cost_models.linear_cost import LinearCost
from instruction_set.mesh import Mesh

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


def collective_form(kind: str, variant: str, g: int, alpha: float, d: float, *,
                    uniform: bool) -> tuple[float, float]:
    """(a, b) of `max_i a + b * s_i` for one collective on a group of g with latency `alpha`
    and `d` = bytes / beta seconds (the formulas of the module docstring; `uniform`: every
    link of the ring is alike)."""
    if kind in ("all_gather", "reduce_scatter"):
        if variant == "padded" or (variant == "ring" and uniform):
            return (g - 1) * alpha, (g - 1) * d
        if variant == "ring":
            return (g - 1) * alpha + d, -d
        if variant == "grouped":
            return g * alpha + d, 0.0
    if kind in ("all_reduce", "all_reduce_max"):
        return 2 * (g - 1) * alpha + 2 * (g - 1) / g * d, 0.0
    if kind == "all_to_all":
        return (g - 1) * alpha, d
    raise ValueError(f"unknown collective {kind}.{variant}")


@dataclass(frozen=True)
class CommModel:
    """Link parameters of the groups along each mesh axis of a cluster. `two_level` False
    treats the devices as one group (no node / cross-node groups, no hierarchical variant)."""

    cluster: ClusterSpec
    two_level: bool = True
    _alpha_beta: dict[tuple[str, str, str], tuple[float, float]] = field(default_factory=dict, repr=False)

    @cached_property
    def mesh(self) -> Mesh:
        mesh = Mesh.of([len(n.devices) for n in self.cluster.nodes])
        return mesh if self.two_level else Mesh(1, self.n, False)

    @property
    def n(self) -> int:
        return self.cluster.num_devices

    def group_size(self, axis: str) -> int:
        return {"all": self.n, "inner": self.mesh.per_node, "outer": self.mesh.num_nodes}[axis]

    def _intra(self) -> AlphaBeta:
        spec, links = self.cluster, self.cluster.links
        intra = [n.intra_bandwidth_gbps or links.intra_node_bandwidth_gbps
                 for n in spec.nodes if len(n.devices) > 1]
        return AlphaBeta(latency_us=links.intra_node_latency_us, bandwidth_gbps=min(intra or [1e9]))

    def _nic(self) -> AlphaBeta:
        links = self.cluster.links
        nics = [n.nic_bandwidth_gbps or links.inter_node_bandwidth_gbps for n in self.cluster.nodes]
        return AlphaBeta(latency_us=links.inter_node_latency_us, bandwidth_gbps=min(nics))

    def link(self, axis: str = "all") -> AlphaBeta:
        """The bottleneck link of a ring along `axis`, from the spec."""
        if axis == "inner" or len(self.cluster.nodes) == 1:
            return self._intra()
        if axis == "outer" and not self.mesh.two_level:
            raise ValueError("no cross-node axis on a one-level mesh")
        nic = self._nic()
        if axis == "outer":
            return AlphaBeta(latency_us=nic.latency_us,
                             bandwidth_gbps=nic.bandwidth_gbps / self.mesh.per_node)
        intra = self._intra()
        return AlphaBeta(latency_us=max(nic.latency_us, intra.latency_us),
                         bandwidth_gbps=min(nic.bandwidth_gbps, intra.bandwidth_gbps))

    def link_class(self, axis: str) -> str:
        return "intra" if axis == "inner" or len(self.cluster.nodes) == 1 else "inter"

    def alpha_beta(self, kind: str, variant: str, axis: str = "all") -> tuple[float, float]:
        """(alpha seconds, beta bytes/second): calibrated for the variant, else the spec's link."""
        key = (kind, variant, axis)
        if key not in self._alpha_beta:
            ab = self._calibrated(kind, variant, axis) or self.link(axis)
            self._alpha_beta[key] = (ab.latency_us * 1e-6, ab.bandwidth_gbps * 1e9 / 8)
        return self._alpha_beta[key]

    def _calibrated(self, kind: str, variant: str, axis: str) -> AlphaBeta | None:
        """The profiled fit for a collective along `axis`: the outer axis's own (measured with
        all its groups at once), else the all-device fit with the NIC shared per_node ways.
        The cross-node step of the hierarchical all-reduce is an outer-axis ring."""
        cal = self.cluster.calibration
        if cal is None:
            return None
        name = "all_reduce.ring" if (kind, variant) == ("all_reduce", "hierarchical") else f"{kind}.{variant}"
        if axis == "outer":
            own, shared = cal.lookup(name, "outer"), cal.lookup(name, "inter")
            if own is None and shared is not None:
                return AlphaBeta(latency_us=shared.latency_us, bandwidth_gbps=shared.bandwidth_gbps / self.mesh.per_node)
            return own
        return cal.lookup(name, self.link_class(axis))

    def cost(self, kind: str, variant: str, nbytes: float, axis: str = "all") -> LinearCost:
        """Forward cost of one collective on `nbytes` per group, along `axis`."""
        n, g = self.n, self.group_size(axis)
        if g == 1 or kind in LOCAL:
            return LinearCost.zero(n)
        if kind == "all_reduce" and variant == "hierarchical":
            return LinearCost.constant(self._hierarchical_allreduce(nbytes, axis), n)
        alpha, beta = self.alpha_beta(kind, variant, axis)
        uniform = self.link_class(axis) == "intra" or axis == "outer"
        a, b = collective_form(kind, variant, g, alpha, nbytes / beta, uniform=uniform)
        return LinearCost((a,) * n, (b,) * n)

    @property
    def hierarchical(self) -> bool:
        """Whether the two-level all-reduce applies: several nodes of equal size > 1."""
        return self.mesh.two_level

    def _hierarchical_allreduce(self, nbytes: float, axis: str) -> float:
        if axis != "all" or not self.hierarchical:
            return float("inf")
        nodes, t = self.mesh.num_nodes, self.mesh.per_node
        alpha_i, beta_i = self.alpha_beta("all_reduce", "ring", "inner")
        alpha_e, beta_e = self.alpha_beta("all_reduce", "hierarchical", "outer")
        beta_e *= t  # the t concurrent cross-node all-reduces carry D/t each
        return (2 * (t - 1) * alpha_i + 2 * (nodes - 1) * alpha_e
                + 2 * (t - 1) / t * nbytes / beta_i + 2 * (nodes - 1) / nodes * nbytes / beta_e)

    def gradient_allreduce(self, nbytes: float, axis: str = "all") -> LinearCost:
        """Gradient all-reduce of a replicated parameter, bucketed as in DDP (Li et al., VLDB
        2020): parameters share all-reduces of GRAD_BUCKET_BYTES, so one parameter pays the
        bandwidth term of its bytes and its bytes' fraction of a bucket's latency term."""
        if self.group_size(axis) == 1:
            return LinearCost.zero(self.n)
        return self.bucketed(self.gradient_variant(nbytes, axis), nbytes, axis)

    def gradient_variant(self, nbytes: float, axis: str = "all") -> str:
        """The cheaper all-reduce variant for gradient buckets along `axis`."""
        variants = VARIANTS["all_reduce"] if axis == "all" and self.hierarchical else ("ring",)
        return min(variants, key=lambda v: self.bucketed(v, nbytes, axis).a[0])

    def bucketed(self, variant: str, nbytes: float, axis: str = "all") -> LinearCost:
        """A variant's cost for `nbytes` inside a GRAD_BUCKET_BYTES bucket: latency pro rata."""
        whole_bytes = max(nbytes, GRAD_BUCKET_BYTES)
        whole = self.cost("all_reduce", variant, whole_bytes, axis).a[0]
        empty = self.cost("all_reduce", variant, 0.0, axis).a[0]
        fraction = min(1.0, nbytes / GRAD_BUCKET_BYTES)
        return LinearCost.constant(empty * fraction + (whole - empty) / whole_bytes * nbytes, self.n)

    def with_adjoint(self, kind: str, variant: str, nbytes: float, grad: bool,
                     axis: str = "all") -> LinearCost:
        """Forward cost plus, when a gradient flows, the adjoint collective's cost."""
        cost = self.cost(kind, variant, nbytes, axis)
        back = ADJOINT.get(kind)
        if grad and back is not None:
            back_variant = variant if variant in VARIANTS[back] else VARIANTS[back][0]
            cost = cost + self.cost(back, back_variant, nbytes, axis)
        return cost
