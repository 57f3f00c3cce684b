"""Interchangeable devices: the planner works on classes of devices, not on every device.

Two devices are interchangeable in a synthesis problem when swapping them changes no cost,
no memory and no constraint of the ratio LP. That holds when they have

- the same device kind (throughput, memory, bandwidth, launch overhead, measured factor);
- the same place in a ring across nodes: both first of their node (the ring crosses a node
  boundary just before them) or both not;
- the same local lengths of every split at the problem's ratios: over all devices, their
  node's block, and inside a node (instruction_set.shards.ShardLengths; largest-remainder
  rounding gives equal-ratio devices lengths that differ by one unit, so this splits a kind
  into at most a few classes);
- nodes of the same composition (how many devices of each class), so that a node's share
  (the all-to-all across nodes, the LP's split across nodes) is the same expression.

The classes are the coarsest partition with these properties, found by refining the first
three keys with the node composition until nothing changes (colour refinement). Every per-
device vector of the cost model (cost_models.linear_cost, cost_models.memory) then has one
entry per class, `max_i` over devices equals `max_c` over classes, and the ratio LP has one
variable per class with the class sizes as multiplicities in `sum_i r_i = 1`. On a cluster
of 8 nodes x 8 GPUs of two kinds that is a handful of classes instead of 64 devices; 4,096
such devices give about as many. The result is expanded to every device at the end (ratios,
shard lengths, per-device predictions).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from typing import Hashable, Sequence

from hetsynth.instruction_set.cluster import ClusterSpec, DeviceKind
from hetsynth.instruction_set.shards import AXES, ShardLengths

NodeType = tuple[tuple[int, int], ...]  # (class, number of its devices in the node), by class


@dataclass(frozen=True)
class DeviceClasses:
    """A partition of a cluster's ranks into classes of interchangeable devices."""

    of_rank: tuple[int, ...]   # the class of every rank
    reps: tuple[int, ...]      # the lowest rank of every class
    counts: tuple[int, ...]    # how many devices each class holds
    node_of: tuple[NodeType, ...]  # the composition of every class's nodes
    starts: tuple[bool, ...]   # the class's devices are first of their node (several nodes)
    num_nodes: int

    @property
    def size(self) -> int:
        return len(self.reps)

    @cached_property
    def node_types(self) -> tuple[NodeType, ...]:
        """The distinct node compositions."""
        return tuple(dict.fromkeys(self.node_of))

    def expand(self, values: Sequence[float]) -> tuple[float, ...]:
        """A per-class vector as a per-device one."""
        return tuple(values[c] for c in self.of_rank)

    def kinds(self, cluster: ClusterSpec) -> list[DeviceKind]:
        return [cluster.device_kind(r) for r in self.reps]

    @staticmethod
    def each_device(cluster: ClusterSpec) -> "DeviceClasses":
        """Every device a class of its own (the cost model's plain per-device form)."""
        return DeviceClasses.of_nodes(cluster.rank_nodes())

    @staticmethod
    def of_nodes(nodes: Sequence[int]) -> "DeviceClasses":
        """Every device a class of its own; `nodes[i]` is device i's node."""
        return _build(list(range(len(nodes))), nodes)


def device_classes(cluster: ClusterSpec, lengths: ShardLengths) -> DeviceClasses:
    """The interchangeable devices of `cluster` at the shard lengths of a problem."""
    nodes = cluster.rank_nodes()
    firsts = _firsts(nodes)
    columns: list[Sequence[Hashable]] = [[d.kind for d in cluster.devices], firsts]
    axes = AXES if lengths.mesh.two_level else AXES[:1]
    columns += [lengths.units(count, axis) for count in lengths.counts for axis in axes]
    return _build(_labels(list(zip(*columns))), nodes)


def _firsts(nodes: Sequence[int]) -> list[bool]:
    several = len(set(nodes)) > 1
    return [several and (r == 0 or nodes[r - 1] != nodes[r]) for r in range(len(nodes))]


def _labels(keys: Sequence[Hashable]) -> list[int]:
    """Small integers for the keys, in order of first appearance."""
    ids: dict[Hashable, int] = {}
    return [ids.setdefault(k, len(ids)) for k in keys]


def _compositions(labels: Sequence[int], nodes: Sequence[int]) -> list[NodeType]:
    """Every rank's node composition: (class, count) pairs sorted by class."""
    per_node: dict[int, Counter] = {}
    for label, node in zip(labels, nodes):
        per_node.setdefault(node, Counter())[label] += 1
    types = {j: tuple(sorted(c.items())) for j, c in per_node.items()}
    return [types[j] for j in nodes]


def _build(labels: list[int], nodes: Sequence[int]) -> DeviceClasses:
    """Refine the labels by node composition until stable, then collect the classes."""
    while True:
        refined = _labels(list(zip(labels, _compositions(labels, nodes))))
        if max(refined) == max(labels):
            break
        labels = refined
    labels = _labels(labels)
    reps: dict[int, int] = {}
    for r, c in enumerate(labels):
        reps.setdefault(c, r)
    counts = Counter(labels)
    comps = _compositions(labels, nodes)
    firsts = _firsts(nodes)
    rep = [reps[c] for c in range(len(reps))]
    return DeviceClasses(of_rank=tuple(labels), reps=tuple(rep), counts=tuple(counts[c] for c in range(len(rep))),
                         node_of=tuple(comps[r] for r in rep), starts=tuple(firsts[r] for r in rep),
                         num_nodes=len(set(nodes)))
