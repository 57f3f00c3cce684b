"""Meshes and sub-meshes (instruction_set.mesh): which ranks share a collective along each axis."""

from __future__ import annotations

import pytest

from hetsynth.instruction_set.mesh import Mesh, MeshAxis


def test_members_along_each_axis() -> None:
    mesh = Mesh.of([4, 4])  # 2 nodes x 4
    assert mesh.axes() == (MeshAxis.ALL, MeshAxis.INNER, MeshAxis.OUTER)
    assert list(mesh.members(MeshAxis.ALL, 5)) == list(range(8))
    assert list(mesh.members(MeshAxis.INNER, 5)) == [4, 5, 6, 7]
    assert list(mesh.members(MeshAxis.OUTER, 5)) == [1, 5]
    assert [mesh.group_size(a) for a in mesh.axes()] == [8, 4, 2]


def test_a_one_level_mesh_has_one_axis() -> None:
    mesh = Mesh.of([3, 2])
    assert mesh.axes() == (MeshAxis.ALL,) and list(mesh.members("all", 4)) == [0, 1, 2, 3, 4]


def test_a_sub_mesh_of_whole_nodes_has_its_own_ranks_and_axes() -> None:
    mesh = Mesh.of([2, 2, 2, 2])
    stage = mesh.sub(1, 2)  # nodes 1 and 2: ranks 2..5
    assert list(stage.ranks) == [2, 3, 4, 5] and stage.two_level
    assert list(stage.members(MeshAxis.INNER, 5)) == [4, 5]
    assert list(stage.members(MeshAxis.OUTER, 5)) == [3, 5]
    assert (stage.node(5), stage.local(5)) == (1, 1)
    one = mesh.sub(3, 1)
    assert list(one.ranks) == [6, 7] and not one.two_level
    with pytest.raises(ValueError, match="nodes 3..4 are not nodes of a mesh of 4 nodes"):
        mesh.sub(3, 2)
