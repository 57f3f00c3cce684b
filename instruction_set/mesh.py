"""The device mesh of a plan: nodes x devices per node, and its sub-meshes.

Ranks are numbered node by node (the cluster spec's device order), so rank
`r = first_rank + node * per_node + local`. A cluster whose nodes all hold the same number
(> 1) of devices, with more than one node, has a 2-d mesh and may use two-level layouts; any
other cluster is one-level (`two_level` False) and uses only one-level layouts. A sub-mesh
(`sub`: some whole nodes of a mesh, as a pipeline stage) has its own axes over its own ranks.
Who shares a collective along an axis (`members`) is answered here only.
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
    first_rank: int = 0  # global rank of the first member (non-zero for a sub-mesh)

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.per_node < 1 or self.first_rank < 0:
            raise ValueError(f"mesh {self.num_nodes} x {self.per_node} from rank {self.first_rank}: needs >= 1 "
                             f"node of >= 1 device and a first rank >= 0")
        if self.two_level and self.num_nodes < 2:
            raise ValueError(f"mesh {self.num_nodes} x {self.per_node}: a two-level mesh needs >= 2 nodes")

    @staticmethod
    def of(node_sizes: list[int]) -> "Mesh":
        n = sum(node_sizes)
        if len(node_sizes) > 1 and len(set(node_sizes)) == 1 and node_sizes[0] > 1:
            return Mesh(len(node_sizes), node_sizes[0], True)
        return Mesh(1, n, False)

    @property
    def size(self) -> int:
        return self.num_nodes * self.per_node

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.size)

    def index(self, rank: int) -> int:
        """`rank`'s member index: where per-member lists (shard lengths, ratios) hold its entry."""
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not a member of the mesh of ranks {self.ranks.start}..{self.ranks.stop - 1}")
        return rank - self.first_rank

    def axes(self) -> tuple[MeshAxis, ...]:
        return tuple(MeshAxis) if self.two_level else (MeshAxis.ALL,)

    def node(self, rank: int) -> int:
        return (rank - self.first_rank) // self.per_node

    def local(self, rank: int) -> int:
        return (rank - self.first_rank) % self.per_node

    def node_ranks(self, node: int) -> range:
        start = self.first_rank + node * self.per_node
        return range(start, start + self.per_node)

    def cross_ranks(self, local: int) -> range:
        """The ranks with this local index on every node (one across-nodes group)."""
        return range(self.first_rank + local, self.first_rank + self.size, self.per_node)

    def members(self, axis: str, rank: int) -> range:
        """The global ranks that share `rank`'s collective along `axis`, in group order."""
        if axis == MeshAxis.ALL:
            return self.ranks
        if axis == MeshAxis.INNER:
            return self.node_ranks(self.node(rank))
        return self.cross_ranks(self.local(rank))

    def group_size(self, axis: str) -> int:
        return {MeshAxis.ALL: self.size, MeshAxis.INNER: self.per_node, MeshAxis.OUTER: self.num_nodes}[axis]

    def sub(self, first_node: int, num_nodes: int) -> "Mesh":
        """The sub-mesh of `num_nodes` whole nodes from `first_node` (two-level when it keeps
        more than one node of more than one device)."""
        if not (0 <= first_node and num_nodes >= 1 and first_node + num_nodes <= self.num_nodes):
            raise ValueError(f"nodes {first_node}..{first_node + num_nodes - 1} are not nodes of a mesh of "
                             f"{self.num_nodes} nodes (0..{self.num_nodes - 1})")
        return Mesh(num_nodes, self.per_node, self.two_level and num_nodes > 1,
                    self.first_rank + first_node * self.per_node)
