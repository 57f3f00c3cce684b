"""The device mesh of a plan: nodes x devices per node.

Ranks are numbered node by node (the cluster spec's device order), so rank
`r = node * per_node + local`. A cluster whose nodes all hold the same number (> 1) of
devices, with more than one node, has a 2-d mesh and may use two-level layouts; any other
cluster is one-level (`two_level` False) and uses only one-level layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class MeshAxis(StrEnum):
    """The axes a collective runs along."""

    ALL = "all"      # every member, one group
    INNER = "inner"  # the members of my node (one group per node)
    OUTER = "outer"  # one member per node with my local index (one group per local index)


@dataclass(frozen=True)
class Mesh:
    num_nodes: int
    per_node: int
    two_level: bool

    @staticmethod
    def of(node_sizes: list[int]) -> "Mesh":
        n = sum(node_sizes)
        if len(node_sizes) > 1 and len(set(node_sizes)) == 1 and node_sizes[0] > 1:
            return Mesh(len(node_sizes), node_sizes[0], True)
        return Mesh(1, n, False)

    @property
    def size(self) -> int:
        return self.num_nodes * self.per_node

    def node(self, rank: int) -> int:
        return rank // self.per_node

    def local(self, rank: int) -> int:
        return rank % self.per_node

    def node_ranks(self, node: int) -> range:
        return range(node * self.per_node, (node + 1) * self.per_node)

    def cross_ranks(self, local: int) -> range:
        """The ranks with this local index on every node (one across-nodes group)."""
        return range(local, self.size, self.per_node)
