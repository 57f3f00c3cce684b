"""Collectives on real gloo process groups (world sizes 2 and 4): every variant, uneven and
zero-length shards, forward values and adjoint backward passes, checked against what one
process computes for the whole tensor."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hetsynth.instruction_set.mesh import Mesh
from hetsynth.runtime.collectives import (Span, all_gather, all_reduce, all_reduce_max, all_to_all,
                                 partial, reduce_scatter, slice_rows)
from hetsynth.runtime.groups import Groups

LENGTHS = {2: [(3, 2), (0, 4), (5, 0)], 4: [(2, 1, 0, 3), (1, 1, 1, 1), (0, 0, 5, 2)]}


def _span(rank: int, world: int, dim: int, lengths: tuple[int, ...]) -> Span:
    return Span(dist.group.WORLD, tuple(range(world)), rank, dim, tuple(lengths))


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference (0 for empty tensors)."""
    d = (a.detach() - b.detach()).abs()
    return float(d.max()) if d.numel() else 0.0


def _full(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def gather_case(rank: int, world: int, variant: str, lengths: tuple[int, ...]) -> float:
    """all_gather of uneven shards along dim 1, then the adjoint (reduce-scatter) of a Partial
    gradient; returns the largest error against the single-process result."""
    full = _full(0, (3, sum(lengths), 2))
    span = _span(rank, world, 1, lengths)
    shard = full.narrow(1, span.offset(rank), lengths[rank]).clone().requires_grad_()
    out = all_gather(shard, span, variant)
    grads = [_full(10 + r, full.shape) for r in range(world)]  # each rank's Partial gradient
    out.backward(grads[rank])
    expected_grad = sum(grads).narrow(1, span.offset(rank), lengths[rank])
    return max(err(out, full), err(shard.grad, expected_grad))


def scatter_case(rank: int, world: int, variant: str, lengths: tuple[int, ...]) -> float:
    parts = [_full(20 + r, (sum(lengths), 3)) for r in range(world)]
    span = _span(rank, world, 0, lengths)
    mine = parts[rank].clone().requires_grad_()
    out = reduce_scatter(mine, span, variant)
    expected = sum(parts).narrow(0, span.offset(rank), lengths[rank])
    grad = _full(99, (sum(lengths), 3)).narrow(0, span.offset(rank), lengths[rank])
    out.backward(grad)
    # the adjoint all-gathers every member's slice of the output gradient
    return max(err(out, expected), err(mine.grad, _full(99, (sum(lengths), 3))))


def all_to_all_case(rank: int, world: int, src: tuple[int, ...], dst: tuple[int, ...]) -> float:
    full = _full(1, (sum(src), sum(dst), 2))
    s, d = _span(rank, world, 0, src), _span(rank, world, 1, dst)
    mine = full.narrow(0, s.offset(rank), src[rank]).clone().requires_grad_()
    out = all_to_all(mine, s, d)
    expected = full.narrow(1, d.offset(rank), dst[rank])
    out.backward(torch.ones_like(out))
    return max(err(out, expected), err(mine.grad, torch.ones_like(mine)))


def reduce_case(rank: int, world: int, hierarchical: bool) -> float:
    parts = [_full(30 + r, (4, 5)) for r in range(world)]
    mine = parts[rank].clone().requires_grad_()
    span = _span(rank, world, 0, (1,) * world)
    levels = None
    if hierarchical:
        groups = Groups.create(Mesh(2, world // 2, True), rank, world=dist.group.WORLD)
        levels = tuple(Span(groups.group(a), tuple(groups.members(a)), groups.index(a), 0, ())
                       for a in ("inner", "outer"))
    out = all_reduce(mine, span, levels)
    grads = [_full(40 + r, (4, 5)) for r in range(world)]
    out.backward(grads[rank])
    mx = all_reduce_max(parts[rank], span)
    return max(err(out, sum(parts)), err(mine.grad, sum(grads)), err(mx, torch.stack(parts).amax(0)))


def local_case(rank: int, world: int) -> float:
    full = _full(5, (6, 4)).requires_grad_()
    piece = slice_rows(full, 0, rank, 1)
    kept = partial(full, rank == 0)
    (piece.sum() + kept.sum()).backward()
    expected = torch.zeros(6, 4, dtype=torch.float64)
    expected[rank] += 1
    if rank == 0:
        expected += 1
    return err(full.grad, expected)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("variant", ["padded", "grouped", "ring"])
def test_all_gather_and_adjoint(pools, world: int, variant: str) -> None:
    for lengths in LENGTHS[world]:
        assert max(pools.get(world).run(gather_case, variant, lengths)) < 1e-12, lengths


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("variant", ["padded", "grouped", "ring"])
def test_reduce_scatter_and_adjoint(pools, world: int, variant: str) -> None:
    for lengths in LENGTHS[world]:
        assert max(pools.get(world).run(scatter_case, variant, lengths)) < 1e-12, lengths


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_all_to_all(pools, world: int) -> None:
    src, dst = LENGTHS[world][0], LENGTHS[world][2]
    assert max(pools.get(world).run(all_to_all_case, src, dst)) < 1e-12


@pytest.mark.parametrize("world,hierarchical", [(2, False), (4, False), (4, True)])
def test_all_reduce(pools, world: int, hierarchical: bool) -> None:
    assert max(pools.get(world).run(reduce_case, hierarchical)) < 1e-12


def test_slice_and_partial_backward(pools) -> None:
    assert max(pools.get(2).run(local_case)) < 1e-12


def group_timeouts(rank: int, world: int) -> list[float]:
    from hetsynth.runtime.groups import group_timeout

    groups = Groups.create(Mesh(2, world // 2, True), rank, world=dist.group.WORLD)
    return [group_timeout(groups.group(a)).total_seconds() for a in ("all", "inner", "outer")]


def test_node_and_cross_node_groups_get_the_run_timeout(pools) -> None:
    """new_group without timeout= would give the node groups torch's 30-minute default."""
    assert pools.get(4).run(group_timeouts) == [[60.0] * 3] * 4


def test_poster_posts_in_order_and_hands_errors_to_the_waiter() -> None:
    """ring.Poster (the fused rings' posting thread): steps run in the order handed, each off
    the calling thread; an error in one reaches whoever waits it, and the next still runs."""
    import threading

    from hetsynth.runtime.collectives.ring import Poster

    poster, seen = Poster(), []

    def step(n: int) -> list:
        seen.append((n, threading.current_thread() is threading.main_thread()))
        if n == 1:
            raise RuntimeError("step 1 failed")
        return []

    handed = [poster.hand(lambda n=n: step(n)) for n in range(3)]
    handed[0].wait()
    with pytest.raises(RuntimeError, match="step 1 failed"):
        handed[1].wait()
    handed[2].wait()
    assert seen == [(0, False), (1, False), (2, False)]


def test_copy_beside_copies_off_the_calling_thread_into_a_no_grad_view() -> None:
    """ring.copy_beside (the fused all-gather's own rows): the copy lands in a view made under
    no_grad, as inside an autograd forward, although grad mode is on in the poster thread."""
    from hetsynth.runtime.collectives.ring import copy_beside

    src = torch.arange(12.0, dtype=torch.float64).reshape(4, 3).requires_grad_()
    with torch.no_grad():
        full = torch.zeros(6, 3, dtype=torch.float64)
        block = full.narrow(0, 1, 4)
    copy_beside(block, src).wait()
    assert torch.equal(full[1:5], src.detach()) and full[0].abs().sum() == 0 and full[5].abs().sum() == 0
