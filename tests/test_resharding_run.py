"""Resharding on real gloo ranks (world size 4, float64): every pair of shipped layouts (R,
S<d> with uneven and zero-length shards, P sources, two-level) between sub-meshes, with each
method. Forward values on an arange tensor are exact; the gradient that flows back is exact
(its sum over the replicas of a source tile is the true gradient, Partial sources each get the
whole of it)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hetsynth.cost_models.flows import NicModel
from hetsynth.instruction_set.mesh import Mesh
from hetsynth.instruction_set.reshard_sides import Placed, reshard_spec
from hetsynth.instruction_set.resharding import ReshardMethod, ReshardPlan, full_box
from hetsynth.planner.resharding import plan_reshard
from hetsynth.runtime.resharding import ReshardContext, reshard

HOSTS = (0, 0, 1, 1)
NICS = NicModel(nic_bytes_s=(1e8, 5e7), loop_bytes_s=(1e9, 1e9), alpha_s=50e-6, loop_alpha_s=5e-6)
SHAPE = (5, 4, 3)
ONE, TWO, THREE = Mesh(1, 1, False, 0), Mesh(1, 2, False, 0), Mesh(1, 3, False, 1)
BACK, ALL4 = Mesh(1, 2, False, 2), Mesh(2, 2, True, 0)

ONE_LEVEL = {  # layout -> per mesh size, lengths (uneven and zero-length)
    "R": {1: {}, 2: {}, 3: {}},
    "S0": {1: {0: (5,)}, 2: {0: (5, 0)}, 3: {0: (2, 0, 3)}},
    "S1": {1: {1: (4,)}, 2: {1: (3, 1)}, 3: {1: (1, 3, 0)}},
}
TWO_LEVEL = [  # (layout, lengths) on ALL4 (nodes of ranks 0-1 and 2-3)
    ("S0|R", {0: (3, 3, 2, 2)}), ("R|S1", {1: (4, 0, 4, 0)}), ("S0|S1", {0: (5, 5, 0, 0), 1: (1, 3, 1, 3)}),
    ("S1", {1: (1, 0, 2, 1)}), ("R", {}),
]


def _cases() -> list[tuple[Placed, Placed]]:
    out = []
    for src_mesh, dst_mesh in ((TWO, BACK), (ONE, THREE), (THREE, ONE)):
        for sl, by_size in {**ONE_LEVEL, "P": {1: {}, 2: {}, 3: {}}}.items():
            for dl, dst_by_size in ONE_LEVEL.items():
                out.append((Placed(src_mesh, sl, by_size[src_mesh.size]),
                            Placed(dst_mesh, dl, dst_by_size[dst_mesh.size])))
    pairs = [(a, b) for a in TWO_LEVEL for b in TWO_LEVEL if a != b]
    out += [(Placed(ALL4, a[0], a[1]), Placed(ALL4, b[0], b[1])) for a, b in pairs]
    out += [(Placed(ALL4, "P", {}), Placed(ALL4, "S0|R", {0: (3, 3, 2, 2)})),
            (Placed(BACK, "S0", {0: (2, 3)}), Placed(ALL4, "S0|S1", {0: (5, 5, 0, 0), 1: (1, 3, 1, 3)}))]
    return out


def _plans(method: ReshardMethod) -> list[ReshardPlan]:
    return [plan_reshard(reshard_spec(f"t{i}", SHAPE, "float64", 8, src, dst, HOSTS), NICS, method=method)
            for i, (src, dst) in enumerate(_cases())]


def _values(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    n = torch.tensor(shape).prod().item()
    t = torch.arange(n, dtype=torch.float64).reshape(shape)
    return t, (t % 7 + 1)


def _summand(t: torch.Tensor, j: int, n: int) -> torch.Tensor:
    """Integer summands of t over n ranks (exact in float64)."""
    base = torch.floor(t / n)
    return base if j < n - 1 else t - (n - 1) * base


def _weight(plan: ReshardPlan, rank: int) -> float:
    """Shares of 1 among the replicas of a destination tile: 1/2, 1/4, ..., the rest to the last."""
    holders = next((t.holders for t in plan.dst_tiles if rank in t.holders), (rank,))
    k = holders.index(rank)
    return 0.5 ** (k + 1) if k < len(holders) - 1 else 0.5 ** k


def run_case(rank: int, plan: ReshardPlan, tag_base: int) -> tuple[bool, torch.Tensor | None]:
    spec = plan.spec
    t, w = _values(spec.shape)
    x = None
    if rank in spec.src.ranks:
        full = _summand(t, spec.src.ranks.index(rank), len(spec.src.ranks)) if spec.src.partial else t
        x = full[spec.src.box_of(rank).within(full_box(spec.shape))].clone().requires_grad_()
    y = reshard(x, ReshardContext(plan, rank, dist.group.WORLD, tag_base=tag_base))
    ok = True
    if rank in spec.dst.ranks:
        index = spec.dst.box_of(rank).within(full_box(spec.shape))
        ok = torch.equal(y.detach(), t[index])
        ((y * w[index]).sum() * _weight(plan, rank)).backward()
    else:
        torch.autograd.backward([y], [y.new_empty(0)])
    return ok, (x.grad if x is not None else None)


def run_all(rank: int, world: int, plans: list[ReshardPlan]) -> list[tuple[bool, torch.Tensor | None]]:
    out = []
    for i, plan in enumerate(plans):
        if rank in plan.spec.src.ranks or rank in plan.spec.dst.ranks:
            out.append(run_case(rank, plan, tag_base=1000 * i))
        else:
            out.append((True, None))
    return out


def _check_grads(plan: ReshardPlan, grads: dict[int, torch.Tensor]) -> None:
    spec = plan.spec
    t, w = _values(spec.shape)
    whole = full_box(spec.shape)
    if spec.src.partial:
        for r in spec.src.ranks:
            assert torch.equal(grads[r], w), (spec.tensor, r)
        return
    summed: dict = {}
    for r, box in zip(spec.src.ranks, spec.src.boxes):
        summed[box] = summed.get(box, 0) + grads[r]
    for box, g in summed.items():
        assert torch.equal(g if torch.is_tensor(g) else torch.zeros(box.shape, dtype=torch.float64), w[box.within(whole)]), \
            (spec.tensor, spec.src.describe, spec.dst.describe, box)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", list(ReshardMethod))
def test_every_layout_pair_exact(pools, method: ReshardMethod) -> None:
    plans = _plans(method)
    results = pools.get(4).run(run_all, plans)
    for i, plan in enumerate(plans):
        for rank in range(4):
            assert results[rank][i][0], (method, plan.spec.src.describe, plan.spec.dst.describe, rank)
        _check_grads(plan, {r: results[r][i][1] for r in plan.spec.src.ranks})
