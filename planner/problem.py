"""The synthesis problem: a reference graph on a cluster at given sharding ratios.

`Problem` precomputes what the search asks for again and again:

- the call nodes in topological order, each with its candidate rules (instruction_set.rules)
  after `Restrictions` (used by the baselines) are applied;
- dim classes and shard lengths (instruction_set.shards) and, per sharded layout, the share
  vector `s_i = len_i / size` that the cost model takes;
- liveness: the index of each tensor's last consumer, so states keep only live tensors;
- compute cost per (node, rule) and the cheapest conversion between two layouts of a tensor
  (one or two collectives, the best variant of each), memoised.

Costs are seconds per training step (forward and backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

from cost_models.cluster import ClusterSpec, DeviceKind
from cost_models.comm import VARIANTS, CommModel
from cost_models.compute import compute_cost
from cost_models.linear_cost import LinearCost
from cost_models.memory import activation_memory, param_memory
from instruction_set.graph import Node, ReferenceGraph, TensorMeta
from instruction_set.layouts import P, PMAX, R, S, Layout, is_shard, shard_dim
from instruction_set.rules import Rule, rules_for
from instruction_set.shards import DimClasses


@dataclass(frozen=True)
class Restrictions:
    """Limits on the program space (for the baselines); the default allows everything."""

    param_layouts: tuple[Layout, ...] | None = None   # None: R or any shard; ("R",): DP
    input_layout: Layout | None = None                # force every input to this layout
    shard_params_with_dims: int | None = None          # params of >= this many dims must shard
    allow_sfb: bool = True
    variants: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Step:
    """One instruction of a conversion path: kind, variant, source and target layouts."""

    kind: str
    variant: str
    src: Layout
    dst: Layout
    cost_s: float
    alternatives: tuple[tuple[str, float], ...] = ()


def rule_links(node: Node, metas: Sequence[TensorMeta], rules: Sequence[Rule]) -> list[tuple]:
    """Pairs of linked (tensor, dim): every sharded entry of a rule with the first one."""
    links = []
    for rule in rules:
        keys = [(node.name, shard_dim(rule.output))] if is_shard(rule.output) else []
        keys += [(t, shard_dim(l)) for t, l in zip(node.inputs, rule.inputs) if is_shard(l)]
        links += [(keys[0], k) for k in keys[1:]]
    return links


class Problem:
    def __init__(self, graph: ReferenceGraph, cluster: ClusterSpec, ratios: Sequence[float],
                 restrictions: Restrictions | None = None, memory_weight: float = 0.0) -> None:
        if len(ratios) != cluster.num_devices:
            raise ValueError(f"{len(ratios)} ratios for {cluster.num_devices} devices")
        self.graph, self.cluster = graph, cluster
        self.ratios = tuple(float(r) for r in ratios)
        self.restrictions = restrictions or Restrictions()
        self.memory_weight = memory_weight  # seconds per byte on the most loaded device
        self.n = cluster.num_devices
        self.kinds: list[DeviceKind] = [cluster.device_kind(r) for r in range(self.n)]
        self.comm = CommModel(cluster)
        self.order: list[Node] = graph.calls
        self.index = {n.name: k for k, n in enumerate(self.order)}
        self.rules = {n.name: rules_for(n, self.in_metas(n)) for n in self.order}
        self.classes = self._classes()
        self._conv: dict[tuple[str, Layout, Layout], tuple[Step, ...] | None] = {}
        self._compute: dict[tuple[str, int], LinearCost] = {}
        self._shares: dict[tuple[str, Layout], tuple[float, ...]] = {}
        self.memo: dict[str, dict] = {}  # memo tables of the search's helpers

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

    def _classes(self) -> DimClasses:
        sizes = {(n.name, d): s for n in self.graph.nodes if n.outputs
                 for d, s in enumerate(n.outputs[0].shape)}
        links = [link for n in self.order for link in rule_links(n, self.in_metas(n), self.rules[n.name])]
        return DimClasses(sizes, links)

    # -- shares and costs -----------------------------------------------------------------
    def shares(self, tensor: str, layout: Layout) -> tuple[float, ...]:
        """Each device's share of `tensor` in `layout` (1 for non-shard layouts)."""
        key = (tensor, layout)
        if key not in self._shares:
            d = shard_dim(layout)
            self._shares[key] = (tuple(self.classes.shares(tensor, d, self.ratios)) if d is not None
                                 else (1.0,) * self.n)
        return self._shares[key]

    def rule_shares(self, node: Node, rule: Rule) -> tuple[float, ...]:
        """Shares of the first sharded entry of a rule (all its sharded dims are linked)."""
        if is_shard(rule.output):
            return self.shares(node.name, rule.output)
        for t, layout in zip(node.inputs, rule.inputs):
            if is_shard(layout):
                return self.shares(t, layout)
        return (1.0,) * self.n

    def compute_linear(self, node: Node, rule_index: int) -> LinearCost:
        key = (node.name, rule_index)
        if key not in self._compute:
            rule = self.rules[node.name][rule_index]
            sharded = is_shard(rule.output) or any(is_shard(l) for l in rule.inputs)
            self._compute[key] = compute_cost(node, self.in_metas(node), sharded, self.kinds)
        return self._compute[key]

    def compute_s(self, node: Node, rule_index: int) -> float:
        """Compute seconds of a node under a rule (plus the memory penalty, if any)."""
        rule = self.rules[node.name][rule_index]
        shares = self.rule_shares(node, rule)
        seconds = self.compute_linear(node, rule_index).at(shares)
        if self.memory_weight:
            sharded = is_shard(rule.output) or any(is_shard(l) for l in rule.inputs)
            mem = activation_memory(node, sharded, self.n).per_device(shares)
            seconds += self.memory_weight * max(mem)
        return seconds

    def storage_penalty(self, tensor: str, layout: Layout) -> float:
        """Memory penalty of storing a parameter in `layout` (0 without a memory weight)."""
        if not self.memory_weight:
            return 0.0
        mem = param_memory(self.meta(tensor).nbytes, is_shard(layout), self.n)
        return self.memory_weight * max(mem.per_device(self.shares(tensor, layout)))

    def collective(self, tensor: str, kind: str, src: Layout, dst: Layout) -> Step:
        """The cheapest allowed variant of one collective on `tensor`, with the alternatives."""
        memo = self.memo.setdefault("collective", {})
        key = (tensor, kind, src, dst)
        if key not in memo:
            memo[key] = self._collective(tensor, kind, src, dst)
        return memo[key]

    def _collective(self, tensor: str, kind: str, src: Layout, dst: Layout) -> Step:
        meta = self.meta(tensor)
        sharded = dst if is_shard(dst) else src
        shares = self.shares(tensor, sharded)
        allowed = self.restrictions.variants.get(kind, VARIANTS[kind])
        options = [(v, self.comm.with_adjoint(kind, v, meta.nbytes, meta.requires_grad).at(shares))
                   for v in allowed]
        variant, cost = min(options, key=lambda o: o[1])
        return Step(kind, variant, src, dst, cost, tuple(options) if len(options) > 1 else ())

    # -- conversions between layouts ------------------------------------------------------
    def shardable_dims(self, tensor: str) -> list[int]:
        return [d for d, s in enumerate(self.meta(tensor).shape) if s > 1]

    def conversion(self, tensor: str, src: Layout, dst: Layout) -> tuple[Step, ...] | None:
        """Cheapest path of at most two instructions from src to dst (None if none)."""
        key = (tensor, src, dst)
        if key not in self._conv:
            paths = [p for p in self._paths(tensor, src, dst) if p is not None]
            self._conv[key] = min(paths, key=lambda p: sum(s.cost_s for s in p)) if paths else None
        return self._conv[key]

    def _one(self, tensor: str, src: Layout, dst: Layout) -> Step | None:
        """A single instruction from src to dst, if one exists."""
        if src == R and is_shard(dst):
            return Step("slice", "local", src, dst, 0.0)
        if src == R and dst == P:
            return Step("partial", "local", src, dst, 0.0)
        if is_shard(src) and dst == R:
            return self.collective(tensor, "all_gather", src, dst)
        if is_shard(src) and is_shard(dst):
            return self.collective(tensor, "all_to_all", src, dst)
        if src == P and dst == R:
            return self.collective(tensor, "all_reduce", src, dst)
        if src == P and is_shard(dst):
            return self.collective(tensor, "reduce_scatter", src, dst)
        if src == PMAX and dst == R and not self.requires_grad(tensor):
            return self.collective(tensor, "all_reduce_max", src, dst)
        return None

    def _paths(self, tensor: str, src: Layout, dst: Layout) -> list[tuple[Step, ...] | None]:
        if src == dst or self.is_multi(tensor):
            return []
        one = self._one(tensor, src, dst)
        paths: list[tuple[Step, ...] | None] = [(one,) if one else None]
        mids = [R] + [S(d) for d in self.shardable_dims(tensor)]
        for mid in mids:
            if mid in (src, dst):
                continue
            a, b = self._one(tensor, src, mid), self._one(tensor, mid, dst)
            if a and b:
                paths.append((a, b))
        return paths
