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
             the shard it received last (the reduce-scatter runs the ring the other way round,
             the all-gather's adjoint, so both cross the same boundaries):
             on equal links (one node, or the inner / outer axis) each step waits for the
             largest shard:  (g-1) * (alpha + max_i s_i * D / beta);
             across nodes the slow links over the C node boundaries of the ring dominate.
             Shard i crosses every boundary but the one just before member i, one step at a
             time; the link over a boundary carries every shard but that of the member just
             after it (a node's first member f):
               (g-1) * alpha + max( max_f (1 - s_f) D, max_f (C-1) s_f D,
                                    max_{i not first} C s_i D ) / beta_nic
    grouped  g * alpha + D / beta                      one (pipelined) broadcast / reduce per
             root, no padding (Thakur et al., IJHPCA 2005; uneven: HAP, EuroSys'24)
  all_reduce
    ring     2 (g-1) alpha + 2 (g-1)/g * D / beta      (Patarasuk & Yuan, 2009)
    hierarchical  (axis all) on N nodes of t devices: reduce-scatter inside each node, t
             concurrent all-reduces of D/t across nodes sharing each NIC, all-gather inside:
             (t-1) (alpha_rs + D/t / beta_rs) + 2 (N-1) alpha_e + 2 (N-1)/N D / beta_e
             + (t-1) (alpha_ag + D/t / beta_ag)      (BlueConnect, Cho et al., SysML 2019)
             Each stage is costed by the fit of the collective the runtime issues for it
             (runtime.collectives.allreduce: the reduce-scatter as an all-to-all of the t
             parts, then the padded all-gather, inside; a ring all-reduce across), not by
             the in-node ring all-reduce's: on local-emulated the all-to-all's fit inside a
             node is 1.4 ms + D / 0.90 Gbit/s, the padded all-gather's 3.2 ms + D / 1.15,
             against the ring all-reduce's 2.6 ms + D / 2.2.
  all_to_all S(a) -> S(b), same shares: member i keeps s_i^2 D and sends s_i (1 - s_i) D
             (receives as much); on equal links (g-1) alpha + max_i s_i (1 - s_i) D / beta;
             across nodes a node n with share S_n sends S_n (1 - S_n) D over its NIC:
             (g-1) alpha + max_n S_n (1 - S_n) D / beta_nic
  slice (R -> S), partial (R -> P): local, free.

Each is a LinearCost in the shares (cost_models.linear_cost) with one entry per class of
interchangeable devices (cost_models.device_classes; one per device when not given); a form that is not affine in the shares (all_to_all's s (1 - s), the ring's per-
member maximum) is linearised at the current shares (`at`): exact there, and for the concave
all_to_all a tangent above it (across nodes: its value there). The backward of a collective
is its adjoint (all_gather <-> reduce_scatter, all_reduce <-> all_reduce, all_to_all <->
all_to_all, slice <-> zero-padding), charged with the same variant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Sequence

from hetsynth.cost_models.device_classes import DeviceClasses, NodeType
from hetsynth.cost_models.linear_cost import LinearCost
from hetsynth.instruction_set.calibration import AlphaBeta
from hetsynth.instruction_set.cluster import ClusterSpec
from hetsynth.instruction_set.kinds import Category, Implementations, kinds
from hetsynth.instruction_set.kinds import kind as instruction_kind
from hetsynth.instruction_set.mesh import Mesh
from hetsynth.instruction_set.program import GRAD_BUCKET_BYTES

Formula = Callable[["CommModel", str, str, float, str, "tuple[float, ...] | None"], LinearCost]
FORMULAS: Implementations[Formula] = Implementations("communication cost")
# the collectives the runtime issues for the hierarchical all-reduce's in-node stages, each
# moving (t-1)/t of the bytes (runtime.collectives.allreduce: an all-to-all of the parts
# then a sum, for the reduce-scatter; the padded all-gather)
HIERARCHICAL_INNER_STAGES = (("all_to_all", "native"), ("all_gather", "padded"))


@dataclass(frozen=True)
class Ring:
    """A ring of all devices across nodes, seen from the entries of the cost vectors (devices,
    or classes of interchangeable devices): whether an entry's devices start a node (a
    boundary just before them), how many node boundaries the ring has, and the distinct node
    compositions as (entry, devices) pairs (for the node shares of the all-to-all)."""

    starts: tuple[bool, ...]
    cuts: int
    nodes: tuple[NodeType, ...]

    @staticmethod
    def of_nodes(nodes: Sequence[int]) -> "Ring":
        """One entry per device, `nodes[j]` the node of the j-th member in ring order."""
        starts = tuple(nodes[j - 1] != nodes[j] for j in range(len(nodes)))
        members: dict[int, list[tuple[int, int]]] = {}
        for j, node in enumerate(nodes):
            members.setdefault(node, []).append((j, 1))
        return Ring(starts, sum(starts), tuple(tuple(m) for m in members.values()))

    @staticmethod
    def of_classes(classes: DeviceClasses) -> "Ring":
        return Ring(classes.starts, classes.num_nodes if classes.num_nodes > 1 else 0, classes.node_types)


def collective_terms(kind: str, variant: str, g: int, alpha: float, d: float, at: Sequence[float],
                     nodes: Sequence[int] | Ring | None = None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per entry i (a device or a class of devices), (a_i, b_i) of `max_i a_i + b_i * s_i`
    for one collective on a group of g with latency `alpha` and `d` = bytes / beta seconds
    (the formulas of the module docstring). `at`: the shares (one per entry) where a form
    that is not affine in the shares is linearised (exact there, a tangent elsewhere).
    `nodes`: the ring across nodes (a Ring, or the node of each member in ring order) when
    the group is every device and spans nodes, None when every link of the ring is alike."""
    n = len(at)
    const = lambda a: ((a,) * n, (0.0,) * n)
    ring = Ring.of_nodes(nodes) if nodes is not None and not isinstance(nodes, Ring) else nodes
    cuts = ring.cuts if ring is not None else 0
    if kind in ("all_gather", "reduce_scatter"):
        if variant == "padded" or (variant == "ring" and not cuts):
            return ((g - 1) * alpha,) * n, ((g - 1) * d,) * n
        if variant == "ring":
            assert ring is not None
            terms = [_ring_term(start, cuts, s) for start, s in zip(ring.starts, at)]
            return tuple((g - 1) * alpha + a * d for a, _ in terms), tuple(b * d for _, b in terms)
        if variant == "grouped":
            return const(g * alpha + d)
    if kind in ("all_reduce", "all_reduce_max"):
        return const(2 * (g - 1) * alpha + 2 * (g - 1) / g * d)
    if kind == "all_to_all":
        if not cuts:  # s_i (1 - s_i) <= s0^2 + (1 - 2 s0) s_i, equal at s0
            return tuple((g - 1) * alpha + s * s * d for s in at), tuple((1 - 2 * s) * d for s in at)
        assert ring is not None
        node_shares = [sum(count * at[e] for e, count in node) for node in ring.nodes]
        return const((g - 1) * alpha + max(v * (1 - v) for v in node_shares) * d)
    raise ValueError(f"unknown collective {kind}.{variant}")


def comm_mesh(cluster: ClusterSpec, two_level: bool = True) -> Mesh:
    """The mesh of the groups: nodes x devices per node, or one level of all devices."""
    mesh = Mesh.of([len(n.devices) for n in cluster.nodes])
    return mesh if two_level else Mesh(1, cluster.num_devices, False)


def _ring_term(start: bool, cuts: int, share: float) -> tuple[float, float]:
    """(a, b) in units of d for block i of a ring across `cuts` node boundaries: a block
    crosses every boundary but the one just before its owner; the link over that boundary,
    when there is one, carries every block but the owner's (the larger of the two at `share`)."""
    if not start:
        return 0.0, float(cuts)
    if 1.0 - share >= (cuts - 1) * share:
        return 1.0, -1.0
    return 0.0, float(cuts - 1)


@dataclass(frozen=True)
class CommModel:
    """Link parameters of the groups along each mesh axis of a cluster. `two_level` False
    treats the devices as one group (no node / cross-node groups, no hierarchical variant).
    Costs have one entry per class of `classes` (default: one per device)."""

    cluster: ClusterSpec
    two_level: bool = True
    classes: DeviceClasses | None = None
    _alpha_beta: dict[tuple[str, str, str], tuple[float, float]] = field(default_factory=dict, repr=False)
    _costs: dict[tuple, LinearCost] = field(default_factory=dict, repr=False)

    @cached_property
    def mesh(self) -> Mesh:
        return comm_mesh(self.cluster, self.two_level)

    @property
    def n(self) -> int:
        """The number of devices."""
        return self.cluster.num_devices

    @cached_property
    def entries(self) -> DeviceClasses:
        """The classes the cost vectors have an entry for."""
        return self.classes if self.classes is not None else DeviceClasses.each_device(self.cluster)

    @property
    def width(self) -> int:
        """The length of every cost vector."""
        return self.entries.size

    def group_size(self, axis: str) -> int:
        return self.mesh.group_size(axis)

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
        """(alpha seconds, beta bytes/second): calibrated for the variant, else the spec's link.
        A calibrated latency is never below the link's own (the spec's): the profile times
        messages of 64 KiB and more, mostly bandwidth on a slow link, and its least-squares
        intercept can land near zero (7 us for the cross-node all-reduce of local-emulated,
        where a 4-byte one takes milliseconds), which made a forward all-reduce of a scalar
        look free next to computing the scalar on every rank."""
        key = (kind, variant, axis)
        if key not in self._alpha_beta:
            link, ab = self.link(axis), self._calibrated(kind, variant, axis)
            if ab is not None and ab.latency_us < link.latency_us:
                ab = AlphaBeta(latency_us=link.latency_us, bandwidth_gbps=ab.bandwidth_gbps)
            ab = ab or link
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

    @cached_property
    def ring(self) -> Ring:
        """The ring of all devices across the cluster's nodes."""
        return Ring.of_classes(self.entries)

    def cost(self, kind: str, variant: str, nbytes: float, axis: str = "all",
             at: Sequence[float] | None = None) -> LinearCost:
        """Forward cost of one collective on `nbytes` per group, along `axis`, linearised at
        the shares `at` (each device's share within its group; even when None) where the
        form is not affine in them. Memoised: the layers of a model repeat the same
        collectives on the same shares."""
        key = (kind, variant, nbytes, axis, tuple(at) if at else None)
        if key not in self._costs:
            self._costs[key] = self._cost(kind, variant, nbytes, axis, key[4])
        return self._costs[key]

    def _cost(self, kind: str, variant: str, nbytes: float, axis: str,
              at: tuple[float, ...] | None) -> LinearCost:
        if self.group_size(axis) == 1 or instruction_kind(kind).category is Category.LOCAL:
            return LinearCost.zero(self.width)
        return FORMULAS.get(kind, variant=variant)(self, kind, variant, nbytes, axis, at)

    def alpha_beta_cost(self, kind: str, variant: str, nbytes: float, axis: str,
                        at: tuple[float, ...] | None) -> LinearCost:
        """The alpha-beta formula of the module docstring, on this cluster's links."""
        n, g = self.width, self.group_size(axis)
        alpha, beta = self.alpha_beta(kind, variant, axis)
        across = self.link_class(axis) == "inter" and axis == "all"
        a, b = collective_terms(kind, variant, g, alpha, nbytes / beta, at or (1.0 / g,) * n,
                                self.ring if across else None)
        return LinearCost(a, b)

    def hierarchical_cost(self, kind: str, variant: str, nbytes: float, axis: str,
                          at: tuple[float, ...] | None) -> LinearCost:
        return LinearCost.constant(self._hierarchical_allreduce(nbytes, axis), self.width)

    @property
    def hierarchical(self) -> bool:
        """Whether the two-level all-reduce applies: several nodes of equal size > 1."""
        return self.mesh.two_level

    def _hierarchical_allreduce(self, nbytes: float, axis: str) -> float:
        if axis != "all" or not self.hierarchical:
            return float("inf")
        nodes, t = self.mesh.num_nodes, self.mesh.per_node
        alpha_e, beta_e = self.alpha_beta("all_reduce", "hierarchical", "outer")
        beta_e *= t  # the t concurrent cross-node all-reduces carry D/t each
        inside = sum((t - 1) * (alpha + nbytes / t / beta) for alpha, beta in
                     (self.alpha_beta(kind, variant, "inner") for kind, variant in HIERARCHICAL_INNER_STAGES))
        return inside + 2 * (nodes - 1) * alpha_e + 2 * (nodes - 1) / nodes * nbytes / beta_e

    def gradient_allreduce(self, nbytes: float, axis: str = "all") -> LinearCost:
        """Gradient all-reduce of a replicated parameter, bucketed as in DDP (Li et al., VLDB
        2020): parameters share all-reduces of GRAD_BUCKET_BYTES, so one parameter pays the
        bandwidth term of its bytes and its bytes' fraction of a bucket's latency term."""
        if self.group_size(axis) == 1:
            return LinearCost.zero(self.width)
        return self.bucketed(self.gradient_variant(nbytes, axis), nbytes, axis)

    def gradient_variant(self, nbytes: float, axis: str = "all") -> str:
        """The cheaper all-reduce variant for gradient buckets along `axis`."""
        variants = instruction_kind("all_reduce").variants if axis == "all" and self.hierarchical else ("ring",)
        return min(variants, key=lambda v: self.bucketed(v, nbytes, axis).a[0])

    def bucketed(self, variant: str, nbytes: float, axis: str = "all") -> LinearCost:
        """A variant's cost for `nbytes` inside a GRAD_BUCKET_BYTES bucket: latency pro rata."""
        whole_bytes = max(nbytes, GRAD_BUCKET_BYTES)
        whole = self.cost("all_reduce", variant, whole_bytes, axis).a[0]
        empty = self.cost("all_reduce", variant, 0.0, axis).a[0]
        fraction = min(1.0, nbytes / GRAD_BUCKET_BYTES)
        return LinearCost.constant(empty * fraction + (whole - empty) / whole_bytes * nbytes, self.width)

    def with_adjoint(self, kind: str, variant: str, nbytes: float, grad: bool,
                     axis: str = "all", at: Sequence[float] | None = None) -> LinearCost:
        """Forward cost plus, when a gradient flows, the adjoint collective's cost (memoised
        with the costs)."""
        back = instruction_kind(kind).adjoint_variant(variant) if grad else None
        if back is None:
            return self.cost(kind, variant, nbytes, axis, at)
        key = ("adjoint", kind, variant, nbytes, axis, tuple(at) if at else None)
        if key not in self._costs:
            self._costs[key] = (self.cost(kind, variant, nbytes, axis, at)
                                + self.cost(back[0].name, back[1], nbytes, axis, at))
        return self._costs[key]


for _kind in kinds(Category.COMMUNICATION):
    FORMULAS.register(_kind.name, CommModel.alpha_beta_cost)
FORMULAS.register("all_reduce", CommModel.hierarchical_cost, variant="hierarchical")
