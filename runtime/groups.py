"""Process groups along the axes of a plan's mesh, passed explicitly to every collective.

    all     every rank
    inner   the ranks of my node                 (mesh row)
    outer   the ranks with my local index        (mesh column: one rank per node)

`torch.distributed.new_group` must be called by every rank for every group in the same order,
so all groups are created together here. `Groups` also answers which member of a group a rank
is; `Groups.local_only` builds the same description without process groups (for code
generation on one machine, `hetsynth explain`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from instruction_set.mesh import Mesh
from runtime.collectives.span import Span


@dataclass
class Groups:
    mesh: Mesh
    rank: int
    handles: dict[str, Any]  # axis -> ProcessGroup (None when built without a process group)

    @staticmethod
    def create(mesh: Mesh, rank: int, *, world: Any) -> "Groups":
        """Create the node and cross-node groups (collective: every rank calls it)."""
        handles: dict[str, Any] = {"all": world}
        if mesh.two_level:
            for node in range(mesh.num_nodes):
                g = dist.new_group(list(mesh.node_ranks(node)))
                if mesh.node(rank) == node:
                    handles["inner"] = g
            for local in range(mesh.per_node):
                g = dist.new_group(list(mesh.cross_ranks(local)))
                if mesh.local(rank) == local:
                    handles["outer"] = g
        return Groups(mesh, rank, handles)

    @staticmethod
    def local_only(mesh: Mesh, rank: int) -> "Groups":
        return Groups(mesh, rank, {"all": None, "inner": None, "outer": None})

    def group(self, axis: str) -> Any:
        return self.handles[axis]

    def members(self, axis: str) -> list[int]:
        """Global ranks of my group along `axis`, in group order."""
        if axis == "all":
            return list(range(self.mesh.size))
        if axis == "inner":
            return list(self.mesh.node_ranks(self.mesh.node(self.rank)))
        return list(self.mesh.cross_ranks(self.mesh.local(self.rank)))

    def index(self, axis: str) -> int:
        return self.members(axis).index(self.rank)

    def span(self, axis: str) -> Span:
        """My whole group along `axis`, nothing split (what an all-reduce needs)."""
        members = tuple(self.members(axis))
        return Span(self.group(axis), members, self.index(axis), 0, (0,) * len(members))
