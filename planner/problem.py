"""The synthesis problem: a reference graph on a cluster at given sharding ratios.

`Problem` precomputes what the search asks for again and again:

- the device mesh (instruction_set.mesh) and, for each call node in topological order, its
  candidate rules: the one-level rules of instruction_set.rules and, on a two-level mesh,
  their products (across nodes x inside a node) whose across-nodes part splits only batch
  dims (or nothing): data parallelism across nodes combined with anything inside a node,
  next to the one-level rules (HAP's space). `Restrictions` (the baselines) narrow this;
- dim classes and shard lengths (instruction_set.shards) and each layout's per-device share;
- the classes of interchangeable devices at these ratios (cost_models.device_classes): every
  per-device vector (costs, shares, memory) has one entry per class, `width` entries;
- liveness: the index of each tensor's last consumer, so states keep only live tensors;
- compute cost per (node, rule) and the cheapest conversion between two layouts of a tensor
  (one or two collectives on some mesh axis, the best variant of each), memoised, and shared
  by tensors of the same structure (shape, dtype, gradient, and per dim its size, dim class
  root and unit and batch-ness: all a conversion's cost depends on), so the layers of a
  repeated block compute each conversion once.

Costs are seconds per training step (forward and backward).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from typing import Sequence

from hetsynth.cost_models.comm import CommModel, comm_mesh
from hetsynth.cost_models.compute import Reference, compute_cost, update_cost
from hetsynth.cost_models.device_classes import DeviceClasses, device_classes
from hetsynth.cost_models.linear_cost import LinearCost
from hetsynth.cost_models.memory import activation_memory, param_memory, saved_name
from hetsynth.cost_models.precision import costed
from hetsynth.instruction_set.cluster import ClusterSpec, DeviceKind
from hetsynth.instruction_set.graph import Node, ReferenceGraph, TensorMeta
from hetsynth.instruction_set.kinds import Category, conversion_kind
from hetsynth.instruction_set.kinds import kind as instruction_kind
from hetsynth.instruction_set.layouts import R, S, Layout, PartialMax, Placement, Replicate
from hetsynth.instruction_set.experts_op import rank_loads
from hetsynth.instruction_set.local import local_kinds
from hetsynth.instruction_set.plan import Plan
from hetsynth.instruction_set.rules import Rule, product_rule, rules_for
from hetsynth.instruction_set.shards import DimClasses, MeshLayout, ShardLengths


# Per live reference graph (by id; graphs are not hashable): its one-level rules and their
# two-level products, which depend on the graph alone, shared by the Problems of one planning
# run (seeds, memory attempts, alternation rounds). An entry goes with its graph.
_PER_GRAPH: dict[int, tuple[weakref.ref, dict]] = {}


def _graph_memo(graph: ReferenceGraph) -> dict:
    entry = _PER_GRAPH.get(id(graph))
    if entry is None or entry[0]() is not graph:
        key = id(graph)
        entry = _PER_GRAPH[key] = (weakref.ref(graph, lambda _: _PER_GRAPH.pop(key, None)), {})
    return entry[1]


class StorageClass(StrEnum):
    """How a parameter is stored: whole (R), split over all devices (S<d>), or split inside
    each node and replicated across nodes (R|S<d>): every storage layout is one of these."""

    REPLICATED = "replicated"
    SHARDED = "sharded"
    SHARDED_INSIDE = "sharded_inside"

    @staticmethod
    def of(layout: Layout) -> "StorageClass":
        if layout is R:
            return StorageClass.REPLICATED
        if layout.shard_dim is not None:
            return StorageClass.SHARDED
        assert layout.outer is Replicate() and layout.inner.is_shard, f"{layout} is no storage layout"
        return StorageClass.SHARDED_INSIDE


@dataclass(frozen=True)
class Restrictions:
    """Limits on the program space (for the baselines); the default allows everything.
    Layouts may be given as text ("S0|R"), read by Layout.parse."""

    param_layouts: frozenset[StorageClass] | None = None
    input_layout: Layout | None = None
    shard_params_with_dims: int | None = None   # params of >= this many dims must be split
    no_batch_split_inside: bool = False          # no axis inside a node splits a batch dim
    batch_split_only: bool = False               # no layout splits anything but batch dims
    two_level: bool = True                       # allow two-level layouts
    allow_sfb: bool = True
    force_sfb: bool = False                      # SFB wherever it applies, even if dearer
    allow_fusion: bool = True                    # fused collective-matmuls (planner.fusions)
    force_fusion: bool = False                   # every fusable pair fused, even if dearer
    variants: dict[str, tuple[str, ...]] = field(default_factory=dict)
    force: dict[str, Layout] = field(default_factory=dict)  # tensor -> layout it is made in
    allow_zero: bool = True                      # the planner may shard optimizer state (planner.zero)

    def __post_init__(self) -> None:
        if self.input_layout is not None:
            object.__setattr__(self, "input_layout", Layout.parse(self.input_layout))
        object.__setattr__(self, "force", {t: Layout.parse(l) for t, l in self.force.items()})
        if self.param_layouts is not None:
            object.__setattr__(self, "param_layouts", frozenset(StorageClass(c) for c in self.param_layouts))


@dataclass(frozen=True, slots=True)
class Step:
    """One instruction of a conversion path: kind, variant, mesh axis, source and target."""

    kind: str
    variant: str
    src: Layout
    dst: Layout
    cost_s: float
    alternatives: tuple[tuple[str, float], ...] = ()
    axis: str = "all"


def rule_entries(node: Node, rule: Rule) -> list[tuple[str, Layout]]:
    """(tensor, layout) of the op's output and of each input under a rule."""
    return [(node.name, rule.output), *zip(node.inputs, rule.inputs)]


def rule_splits(rule: Rule) -> bool:
    """Whether the rule splits the op's work (some entry is sharded)."""
    return any(l.is_shard for l in (rule.output, *rule.inputs))


def rule_links(node: Node, rules: Sequence[Rule]) -> list[tuple]:
    """Pairs of linked (tensor, dim): every sharded entry of a rule with the first one, apart
    from a rule's work inputs, linked among themselves (instruction_set.rules.registry)."""
    links = []
    for rule in rules:
        apart = {i + 1 for i in rule.work_inputs}  # rule_entries puts the output first
        for group in (False, True):
            keys = [(t, l.shard_dim) for k, (t, l) in enumerate(rule_entries(node, rule))
                    if l.shard_dim is not None and (k in apart) == group]
            links += [(keys[0], k) for k in keys[1:]]
    return links


class Problem:
    def __init__(self, graph: ReferenceGraph, cluster: ClusterSpec, ratios: Sequence[float],
                 restrictions: Restrictions | None = None, memory_weight: float = 0.0,
                 state_ratios: Sequence[float] | None = None) -> None:
        if len(ratios) != cluster.num_devices:
            raise ValueError(f"{len(ratios)} ratios for {cluster.num_devices} devices")
        if state_ratios is not None and len(state_ratios) != cluster.num_devices:
            raise ValueError(f"{len(state_ratios)} state ratios for {cluster.num_devices} devices")
        # q: each device's share of the ZeRO-1 parameters' optimizer state (planner.zero)
        self.state_ratios = None if state_ratios is None else tuple(float(q) for q in state_ratios)
        self.graph, self.cluster = graph, cluster
        self.ratios = tuple(float(r) for r in ratios)
        self.restrictions = restrictions or Restrictions()
        self.memory_weight = memory_weight  # seconds per byte on the most loaded device
        self.order: list[Node] = graph.calls
        self.index = {n.name: k for k, n in enumerate(self.order)}
        self._shared = _graph_memo(graph)  # what depends on the graph alone
        base = self._shared.get("base") or self._shared.setdefault(
            "base", {n.name: rules_for(n, self.in_metas(n)) for n in self.order})
        self.classes = self._shared.get("classes") or self._shared.setdefault(
            "classes", DimClasses(self._sizes(), [l for n in self.order for l in rule_links(n, base[n.name])]))
        self.mesh = comm_mesh(cluster, self.restrictions.two_level)
        self.lengths = ShardLengths(self.classes, self.ratios, self.mesh)
        self.devices: DeviceClasses = device_classes(cluster, self.lengths)
        self.width = self.devices.size
        self.kinds: list[DeviceKind] = self.devices.kinds(cluster)
        self.comm = CommModel(cluster, two_level=self.restrictions.two_level, classes=self.devices)
        space = (self.mesh.two_level, self.restrictions.no_batch_split_inside, self.restrictions.batch_split_only,
                 tuple(sorted((t, str(l)) for t, l in self.restrictions.force.items())))
        rules = self._shared.setdefault("rules", {})  # what _rules reads of the restrictions and mesh
        if space not in rules:
            rules[space] = {n.name: self._rules(n, base[n.name]) for n in self.order}
        self.rules = rules[space]
        empty = [n.name for n in self.order if not self.rules[n.name]]
        if empty:
            forced = {t: self.restrictions.force[t] for t in empty if t in self.restrictions.force}
            raise ValueError(f"no sharding rule of op(s) {empty[:5]} is allowed by the restrictions"
                             + (f" (forced layouts {forced})" if forced else "")
                             + "; force another layout or relax the restrictions")
        self._conv: dict[tuple[str, Layout, Layout], tuple[Step, ...] | None] = {}
        self._compute: dict[tuple[str, int], LinearCost] = {}
        self._shares: dict[tuple[str, Layout], tuple[float, ...]] = {}
        self.memo: dict[str, dict] = {}  # memo tables of the search's helpers

    @property
    def state_shares(self) -> tuple[float, ...]:
        """q per device class (its first device's: the state LP gives a class one ratio)."""
        assert self.state_ratios is not None, "a zero1 parameter needs the problem's state ratios"
        return tuple(self.state_ratios[r] for r in self.devices.reps)

    # -- graph facts ----------------------------------------------------------------------
    def meta(self, tensor: str) -> TensorMeta:
        return self.graph.node(tensor).outputs[0]

    def in_metas(self, node: Node) -> tuple[TensorMeta, ...]:
        return tuple(self.meta(t) for t in node.inputs)

    @cached_property
    def last_use(self) -> dict[str, int]:
        last = {}
        for k, node in enumerate(self.order):
            for t in node.inputs:
                last[t] = k
        last[self.graph.loss] = len(self.order)
        return last

    def requires_grad(self, tensor: str) -> bool:
        return self.meta(tensor).requires_grad

    def is_multi(self, tensor: str) -> bool:
        return self.graph.node(tensor).multi_output

    def _sizes(self) -> dict[tuple[str, int], int]:
        return {(n.name, d): s for n in self.graph.nodes if n.outputs for d, s in enumerate(n.outputs[0].shape)}

    # -- the layout space -----------------------------------------------------------------
    @cached_property
    def batch_classes(self) -> frozenset[int]:
        """Dim classes of the data's batch dim (dim 0 of every graph input)."""
        return frozenset(self.classes.class_id(n.name, 0) for n in self.graph.nodes
                         if n.op == "input" and n.outputs and n.outputs[0].shape)

    def is_batch(self, tensor: str, placement: Placement) -> bool:
        d = placement.dim
        return d is not None and self.classes.class_id(tensor, d) in self.batch_classes

    def allowed(self, tensor: str, layout: Layout) -> bool:
        """Whether a layout is in the restricted space (Megatron: no batch split inside nodes)."""
        if layout.is_two_level and not self.mesh.two_level:
            return False
        if self.restrictions.no_batch_split_inside and self.is_batch(tensor, layout.inner):
            return False
        if self.restrictions.batch_split_only:
            return all(not p.is_shard or self.is_batch(tensor, p) for p in (layout.outer, layout.inner))
        return True

    def _batch_only(self, node: Node, rule: Rule) -> bool:
        """An across-nodes rule: it splits only batch dims (or nothing)."""
        return all(self.is_batch(t, l.outer) for t, l in rule_entries(node, rule) if l.is_shard)

    def _rules(self, node: Node, base: list[Rule]) -> list[Rule]:
        rules = list(base)
        if self.mesh.two_level:
            rules += self._products(node, base)
        forced = self.restrictions.force.get(node.name)
        return [r for r in rules if all(self.allowed(t, l) for t, l in rule_entries(node, r))
                and (forced is None or r.output == forced)]

    def _products(self, node: Node, base: list[Rule]) -> list[Rule]:
        """The two-level products of a node's rules (the same for every Problem of the graph)."""
        memo = self._shared.setdefault("products", {})
        if node.name not in memo:
            outer = [r for r in base if self._batch_only(node, r)]
            memo[node.name] = [p for ro in outer for ri in base if ro is not ri
                               for p in [product_rule(ro, ri)] if p is not None]
        return memo[node.name]

    def saved_tensors(self) -> frozenset[str]:
        """The tensors some op saves for the backward pass (an input or an output, not a buffer
        of its own), found once per graph."""
        if "saved" not in self._shared:
            self._shared["saved"] = frozenset(saved_name(node, t) for node in self.order for t in node.saved or ()
                                              if t.source != "internal")
        return self._shared["saved"]

    # -- shares and costs -----------------------------------------------------------------
    def shares(self, tensor: str, layout: Layout) -> tuple[float, ...]:
        """Each device's fraction of `tensor`'s elements in `layout` (1 when not split)."""
        key = (tensor, layout)
        if key not in self._shares:
            self._shares[key] = (self.lengths.rank_shares(tensor, layout, self.devices.reps)
                                 if layout.is_shard else (1.0,) * self.width)
        return self._shares[key]

    def rule_shares(self, node: Node, rule: Rule) -> tuple[float, ...]:
        """Each device's fraction of the op's work: the smallest share among split entries (among
        the rule's work inputs, where it names them)."""
        entries = rule_entries(node, rule)
        if rule.work_inputs:
            entries = [entries[i + 1] for i in rule.work_inputs]
        if node.name in self.graph.expert_loads and rule.inputs[3].is_shard:
            return self._per_node(node, rule, self.expert_load_shares(node, rule.inputs[3]))
        split = [self.shares(t, l) for t, l in entries if l.is_shard]
        if not split:
            return (1.0,) * self.width
        return self._per_node(node, rule, tuple(min(v) for v in zip(*split)))

    def _per_node(self, node: Node, rule: Rule, work: tuple[float, ...]) -> tuple[float, ...]:
        """A rule whose work inputs split inside each node (R|S0) while its first input splits
        across nodes (routed experts dispatched inside a node, each node with its own tokens):
        a device's work is its node's share of the first input times its share there."""
        if not rule.work_inputs or not rule.inputs[rule.work_inputs[0]].is_two_level \
                or not rule.inputs[0].outer.is_shard:
            return work
        node_share = self.shares(node.inputs[0], Layout(rule.inputs[0].outer, Replicate()))
        return tuple(w * t for w, t in zip(work, node_share))

    def expert_load_shares(self, node: Node, layout: Layout) -> tuple[float, ...]:
        """Each class's fraction of a routed-experts op's pairs with its experts split in
        `layout`, under the graph's expected loads l_e (instruction_set.experts_op): a device
        holding experts [o, o + n) gets sum_{e in [o, o + n)} l_e, and a class the largest
        of its devices' (the step waits for the busiest)."""
        memo = self.memo.setdefault("load_shares", {})
        key = (node.name, layout)
        if key not in memo:
            lengths = self.lengths.rank_lengths(node.inputs[3], layout)[0]
            out = [0.0] * self.width
            for rank, load in enumerate(rank_loads(self.graph.expert_loads[node.name], lengths,
                                                   MeshLayout(self.mesh, layout))):
                c = self.devices.of_rank[rank]
                out[c] = max(out[c], load)
            memo[key] = tuple(out)
        return memo[key]

    def compute_linear(self, node: Node, rule_index: int) -> LinearCost:
        key = (node.name, rule_index)
        if key not in self._compute:
            sharded = rule_splits(self.rules[node.name][rule_index])
            self._compute[key] = compute_cost(node, self.in_metas(node), sharded, self.kinds, self.reference)
        return self._compute[key]

    def compute_s(self, node: Node, rule_index: int) -> float:
        """Compute seconds of a node under a rule (plus the memory penalty, if any), shared by
        nodes of the same op structure under rules of the same layouts (the layers of a
        repeated block)."""
        memo = self.memo.setdefault("compute_s", {})
        key = (node.name, rule_index)
        if key not in memo:
            shared = self.memo.setdefault("compute_s_shared", {})
            rule = self.rules[node.name][rule_index]
            skey = (self._op_id(node), rule.inputs, rule.output)
            if skey not in shared:
                shared[skey] = self._compute_s(node, rule_index)
            memo[key] = shared[skey]
        return memo[key]

    def _op_id(self, node: Node) -> int:
        """A small integer naming all a node's compute cost depends on besides the rule's
        layouts: op, FLOPs, measured time, outputs, the structure of inputs and output, and the
        expected loads of routed experts."""
        memo = self.memo.setdefault("op_id", {})
        if node.name not in memo:
            ids = self.memo.setdefault("op_ids", {})
            key = (node.target, node.flops_fwd, node.flops_bwd, node.measured_s,
                   tuple((o.shape, o.dtype, o.requires_grad) for o in node.outputs),
                   tuple(self.structure_id(t) for t in node.inputs),
                   self.structure_id(node.name) if node.outputs else None,
                   self.graph.expert_loads.get(node.name))
            memo[node.name] = ids.setdefault(key, len(ids))
        return memo[node.name]

    def _compute_s(self, node: Node, rule_index: int) -> float:
        rule = self.rules[node.name][rule_index]
        shares = self.rule_shares(node, rule)
        seconds = self.compute_linear(node, rule_index).at(shares)
        inside = self.op_communication(node, rule)
        if inside is not None:
            seconds += inside[0].at(inside[1])
        if self.memory_weight:
            memory = activation_memory(node, rule.inputs, rule.output, self.width, shares, self.shares)
            seconds += self.memory_weight * max(memory.per_device(shares))
        return seconds

    def op_communication(self, node: Node, rule: Rule) -> tuple[LinearCost, tuple[float, ...], str] | None:
        """(cost, shares, axis) of the collectives an op runs inside itself under `rule`, or
        None. Routed experts dispatched (instruction_set.rules.moe): the k T H pairs' rows go
        to their experts' ranks and the results come back, two all-to-alls and their adjoints
        in the backward pass, each costed as the instruction set's all-to-all of the tokens
        at their shares (a rank sends t_i (1 - e_i) of the rows and receives (1 - t_i) e_i;
        taken at e = t, the s (1 - s) of cost_models.comm); the exchange of counts is one
        latency each, left out."""
        if "experts_dispatched" not in local_kinds(rule.local):
            return None
        x, layout = node.inputs[0], rule.inputs[0]
        axis = "inner" if rule.inputs[3].is_two_level else "all"
        shares, nbytes = self.axis_shares(x, layout, layout, axis)
        rows = nbytes * self.meta(node.inputs[1]).shape[1]
        one = self.comm.with_adjoint("all_to_all", "native", rows, self.requires_grad(x), axis, shares)
        return one + one, shares, axis

    def update_linear(self, tensor: str, layout: Layout) -> LinearCost:
        """The optimizer step of a parameter stored in `layout` (cost_models.compute)."""
        node = self.graph.node(tensor)
        return update_cost(node, layout.is_shard, self.kinds, self.graph.update_s, self.reference)

    def update_rows_linear(self, tensor: str) -> LinearCost:
        """The optimizer step of a parameter on a device's rows: b_i times its state share."""
        return update_cost(self.graph.node(tensor), True, self.kinds, self.graph.update_s, self.reference)

    @cached_property
    def reference(self) -> Reference | None:
        """The machine that timed the graph's ops, if they were timed."""
        g = self.graph
        if not g.reference_flops:
            return None
        scales = g.device_scales or {}
        return Reference(g.reference_flops, tuple(scales.get(k) for k in self.device_kind_names))

    @property
    def device_kind_names(self) -> list[str]:
        """The device kind of every class."""
        return [self.cluster.devices[r].kind for r in self.devices.reps]

    def storage_cost(self, tensor: str, layout: Layout) -> float:
        """Seconds of storing a parameter in `layout`: its optimizer step, plus the memory
        penalty (0 without a memory weight)."""
        shares = self.shares(tensor, layout)
        seconds = self.update_linear(tensor, layout).at(shares)
        if not self.memory_weight:
            return seconds
        mem = param_memory(self.meta(tensor).nbytes, layout.is_shard, self.width)
        return seconds + self.memory_weight * max(mem.per_device(shares))

    # -- collectives ----------------------------------------------------------------------
    def axis_shares(self, tensor: str, src: Layout, dst: Layout, axis: str) -> tuple[tuple[float, ...], float]:
        """(each device's share of the split dim within its group, bytes moved per group)."""
        nbytes = float(self.meta(tensor).nbytes)
        if axis == "all":
            return self.shares(tensor, dst if dst.is_shard else src), nbytes
        split = dst if dst.axis(axis).is_shard else src  # the side whose placement on this axis splits
        outer, inner = split.outer, split.inner
        if axis == "inner":
            held = self.shares(tensor, Layout(outer, Replicate()))  # what a node works on
            part = self.shares(tensor, split)
            return tuple(p / h if h else 0.0 for p, h in zip(part, held)), nbytes * max(held)
        held = self.shares(tensor, Layout(Replicate(), inner))       # what one cross-node group works on
        return self.shares(tensor, Layout(outer, Replicate())), nbytes * max(held)

    def collective(self, tensor: str, kind: str, src: Layout, dst: Layout, axis: str = "all") -> Step:
        """The cheapest allowed variant of one collective on `tensor`, with the alternatives."""
        memo = self.memo.setdefault("collective", {})
        key = (tensor, kind, src, dst, axis)
        if key not in memo:
            shares, nbytes = self.axis_shares(tensor, src, dst, axis)
            grad = self.requires_grad(tensor)
            allowed = self.restrictions.variants.get(kind, instruction_kind(kind).variants)
            options = [(v, self.comm.with_adjoint(kind, v, nbytes, grad, axis, shares).at(shares)) for v in allowed]
            options = [o for o in options if math.isfinite(o[1])] or options  # drop inapplicable variants
            variant, cost = min(options, key=lambda o: o[1])
            memo[key] = Step(kind, variant, src, dst, cost, tuple(options) if len(options) > 1 else (), axis)
        return memo[key]

    # -- conversions between layouts ------------------------------------------------------
    def shardable_dims(self, tensor: str) -> list[int]:
        return [d for d, s in enumerate(self.meta(tensor).shape) if s > 1]

    def conversion(self, tensor: str, src: Layout, dst: Layout) -> tuple[Step, ...] | None:
        """Cheapest path of at most two instructions from src to dst (None if none)."""
        key = (tensor, src, dst)
        if key not in self._conv:
            shared = self.memo.setdefault("conversion", {})
            skey = (self.structure(tensor), src, dst)
            if skey not in shared:
                paths = [p for p in self._paths(tensor, src, dst) if p is not None]
                shared[skey] = min(paths, key=lambda p: sum(s.cost_s for s in p)) if paths else None
            self._conv[key] = shared[skey]
        return self._conv[key]

    def structure(self, tensor: str) -> tuple:
        """What the conversions of a tensor depend on (its steps name no tensor)."""
        memo = self.memo.setdefault("structure", {})
        if tensor not in memo:
            meta = self.meta(tensor)
            dims = []
            for d, size in enumerate(meta.shape):
                cls = self.classes.classes[self.classes.class_id(tensor, d)]
                dims.append((size, cls.root_size, cls.unit, self.classes.class_id(tensor, d) in self.batch_classes))
            memo[tensor] = (meta.dtype, meta.requires_grad, self.is_multi(tensor), tuple(dims))
        return memo[tensor]

    def structure_id(self, tensor: str) -> int:
        """A small integer naming structure(tensor), cheap to hash in memo keys."""
        memo = self.memo.setdefault("structure_id", {})
        if tensor not in memo:
            ids = self.memo.setdefault("structure_ids", {})
            memo[tensor] = ids.setdefault(self.structure(tensor), len(ids))
        return memo[tensor]

    def _axis_step(self, tensor: str, a: Placement, b: Placement, src: Layout, dst: Layout,
                   axis: str) -> Step | None:
        """The instruction turning placement a into b along one axis (src -> dst overall): the
        registered layout change of that pattern (instruction_set.kinds), where it may run."""
        k = conversion_kind(a.kind, b.kind)
        if k is None or axis not in k.axes or (k.gradient is False and self.requires_grad(tensor)):
            return None
        if k.category is Category.LOCAL:
            return Step(k.name, k.variants[0], src, dst, 0.0, axis=axis)
        return self.collective(tensor, k.name, src, dst, axis)

    def _one(self, tensor: str, src: Layout, dst: Layout) -> Step | None:
        """A single instruction from src to dst, if one exists."""
        memo = self.memo.setdefault("one", {})
        key = (tensor, src, dst)
        if key not in memo:
            memo[key] = self._single(tensor, src, dst)
        return memo[key]

    def _single(self, tensor: str, src: Layout, dst: Layout) -> Step | None:
        options = []
        if not src.is_two_level and not dst.is_two_level:
            options.append(self._axis_step(tensor, src.outer, dst.outer, src, dst, "all"))
        if self.mesh.two_level:
            (so, si), (do, di), pmax = (src.outer, src.inner), (dst.outer, dst.inner), PartialMax()
            if so is do and si is not di and pmax not in (si, di):
                options.append(self._axis_step(tensor, si, di, src, dst, "inner"))
            if si is di and so is not do and pmax not in (so, do) and not self._nested(si, so, do):
                options.append(self._axis_step(tensor, so, do, src, dst, "outer"))
        options = [o for o in options if o is not None]
        return min(options, key=lambda s: s.cost_s) if options else None

    @staticmethod
    def _nested(inner: Placement, *outers: Placement) -> bool:
        """An inside split of the same dim as an across split: the node blocks would move."""
        d = inner.dim
        return d is not None and any(o.dim == d for o in outers)

    def _mids(self, tensor: str, src: Layout, dst: Layout) -> list[Layout]:
        mids = [R] + [S(d) for d in self.shardable_dims(tensor)]
        if self.mesh.two_level:
            pmax = PartialMax()  # exists one-level only (a mixed pair reaches nothing)
            mids += [Layout(a, b) for a in (src.outer, dst.outer) for b in (src.inner, dst.inner)
                     if (a is pmax) == (b is pmax)]
        return [m for m in dict.fromkeys(mids) if m not in (src, dst) and self.allowed(tensor, m)]

    def _paths(self, tensor: str, src: Layout, dst: Layout) -> list[tuple[Step, ...] | None]:
        if src == dst or self.is_multi(tensor):
            return []
        one = self._one(tensor, src, dst)
        paths: list[tuple[Step, ...] | None] = [(one,) if one else None]
        for mid in self._mids(tensor, src, dst):
            a, b = self._one(tensor, src, mid), self._one(tensor, mid, dst)
            if a and b:
                paths.append((a, b))
        return paths


def plan_problem(plan: Plan, *, states: bool = True) -> Problem:
    """The problem a finished plan lives in: its graph, cluster (both as its precision costs
    them: plan_views) and ratios, the restrictions its mesh records (a one-level plan's problem
    has a one-level mesh: no inner/outer axes, no two-level layouts or device classes) and, with `states`, its ZeRO-1 state ratios (a program
    with zero1 parameters cannot be costed without them). Every re-costing of a plan builds its
    problem here."""
    state_ratios = plan.state_shards.ratios if states and plan.state_shards else None
    graph, cluster = plan_views(plan)
    return Problem(graph, cluster, plan.sharding_ratios, plan_restrictions(plan), state_ratios=state_ratios)


def plan_views(plan: Plan) -> tuple[ReferenceGraph, ClusterSpec]:
    """The plan's graph and cluster as its precision policy costs them (cost_models.precision):
    the kinds at their compute dtypes' rates, the activations at their width."""
    return costed(plan.graph, plan.cluster, plan.precision_policy())


def plan_restrictions(plan: Plan) -> Restrictions:
    """What a plan records of the restrictions it was made under: whether its mesh is two-level."""
    return Restrictions(two_level=plan.mesh.two_level)
