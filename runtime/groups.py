"""Process groups along the axes of a plan's mesh, passed explicitly to every collective.

    all     every rank
    inner   the ranks of my node                 (mesh row)
    outer   the ranks with my local index        (mesh column: one rank per node)

`torch.distributed.new_group` must be called by every rank for every group in the same order,
so all groups are created together here. Every group gets the collective timeout of `world`
(the run's `--timeout`): `new_group` without `timeout=` would use torch's 30-minute default, and
a rank stuck in a node or cross-node collective would hang the run for that long. `Groups` also answers which member of a group a rank
is; `Groups.local_only` builds the same description without process groups (for code
generation on one machine, `hetsynth explain`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hetsynth.instruction_set.mesh import Mesh
from hetsynth.runtime.collectives.span import Span


@dataclass
class Groups:
    mesh: Mesh
    rank: int
    handles: dict[str, Any]  # axis -> ProcessGroup (None when built without a process group)

    @staticmethod
    def create(mesh: Mesh, rank: int, *, world: Any, timeout: datetime.timedelta | None = None) -> "Groups":
        """Create the node and cross-node groups (collective: every rank calls it), with
        `timeout` (default: the timeout `world` was created with)."""
        handles: dict[str, Any] = {"all": world}
        if mesh.two_level:
            handles |= Groups._axis_handles(mesh, rank, timeout or group_timeout(world))
        return Groups(mesh, rank, handles)

    @staticmethod
    def for_stages(meshes: list[Mesh], rank: int, *, world: Any) -> "Groups":
        """The groups of `rank`'s pipeline stage: one per axis of each stage's sub-mesh (whose
        "all" is the stage's ranks, not the world). Collective: every rank creates every stage's
        groups, in stage order."""
        timeout, mine = group_timeout(world), None
        for mesh in meshes:
            handles = {"all": dist.new_group(list(mesh.ranks), timeout=timeout)}
            if mesh.two_level:
                handles |= Groups._axis_handles(mesh, rank, timeout)
            if rank in mesh.ranks:
                mine = Groups(mesh, rank, handles)
        assert mine is not None, (rank, meshes)
        return mine

    @staticmethod
    def _axis_handles(mesh: Mesh, rank: int, timeout: datetime.timedelta) -> dict[str, Any]:
        handles: dict[str, Any] = {}
        for node in range(mesh.num_nodes):
            g = dist.new_group(list(mesh.node_ranks(node)), timeout=timeout)
            if rank in mesh.ranks and mesh.node(rank) == node:
                handles["inner"] = g
        for local in range(mesh.per_node):
            g = dist.new_group(list(mesh.cross_ranks(local)), timeout=timeout)
            if rank in mesh.ranks and mesh.local(rank) == local:
                handles["outer"] = g
        return handles

    @staticmethod
    def local_only(mesh: Mesh, rank: int) -> "Groups":
        return Groups(mesh, rank, {"all": None, "inner": None, "outer": None})

    def group(self, axis: str) -> Any:
        return self.handles[axis]

    def members(self, axis: str) -> list[int]:
        """Global ranks of my group along `axis`, in group order."""
        return list(self.mesh.members(axis, self.rank))

    def index(self, axis: str) -> int:
        return self.members(axis).index(self.rank)

    def span(self, axis: str) -> Span:
        """My whole group along `axis`, nothing split (what an all-reduce needs)."""
        members = tuple(self.members(axis))
        return Span(self.group(axis), members, self.index(axis), 0, (0,) * len(members))


def group_timeout(group: Any) -> datetime.timedelta:
    """The collective timeout a process group was created with (torch has no public getter:
    its backend's options carry it, for gloo and NCCL alike)."""
    device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
    return group._get_backend(device).options._timeout
