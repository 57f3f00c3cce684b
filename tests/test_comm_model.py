"""The communication cost forms (cost_models.comm) that depend on the shares beyond an affine
max: all_to_all moves s_i (1 - s_i) D per device (across nodes S_n (1 - S_n) D per NIC), and a
ring across nodes pays every boundary a big shard crosses, one step at a time."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetsynth.cost_models.comm import CommModel, collective_terms
from hetsynth.instruction_set.cluster import load_cluster

CLUSTER = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "local-emulated.toml"
D = 1.0  # seconds of the whole tensor at beta
TWO_NODES = (0, 0, 1, 1)


def seconds(kind: str, variant: str, shares: list[float], nodes=None, at=None) -> float:
    a, b = collective_terms(kind, variant, len(shares), 0.0, D, at or shares, nodes)
    return max(x + y * s for x, y, s in zip(a, b, shares))


@pytest.mark.parametrize("shares, expected", [
    ([0.25] * 4, 0.1875),                # 3/4 of a quarter leaves every device
    ([0.9, 0.1 / 3, 0.1 / 3, 0.1 / 3], 0.09),
    ([1.0, 0.0, 0.0, 0.0], 0.0),          # one device holds everything: nothing moves
])
def test_all_to_all_moves_what_leaves_each_device(shares: list[float], expected: float) -> None:
    assert seconds("all_to_all", "native", shares) == pytest.approx(expected)


def test_all_to_all_linearisation_is_a_tangent_above() -> None:
    """Linearised at the even shares, exact there and never below the true cost (concave)."""
    even = [0.25] * 4
    for shares in ([0.25] * 4, [0.4, 0.3, 0.2, 0.1], [0.7, 0.1, 0.1, 0.1]):
        assert seconds("all_to_all", "native", shares, at=even) >= seconds("all_to_all", "native", shares) - 1e-12
    assert seconds("all_to_all", "native", even, at=even) == pytest.approx(0.1875)


def test_all_to_all_across_nodes_is_bound_by_the_node_shares() -> None:
    # node 0 holds 0.8 of the rows: 0.8 * 0.2 of the tensor crosses each way
    assert seconds("all_to_all", "native", [0.4, 0.4, 0.1, 0.1], TWO_NODES) == pytest.approx(0.16)
    assert seconds("all_to_all", "native", [0.25] * 4, TWO_NODES) == pytest.approx(0.25)


@pytest.mark.parametrize("shares, expected", [
    ([0.25] * 4, 0.75),                   # each boundary's link carries three quarters
    # the big shard starts node 0: it crosses one boundary, whose link carries all but 1/30
    ([0.9, 0.1 / 3, 0.1 / 3, 0.1 / 3], 1 - 0.1 / 3),
    ([0.1 / 3, 0.9, 0.1 / 3, 0.1 / 3], 1.8),  # behind a boundary: crosses both, one step each
])
def test_ring_across_nodes_counts_the_boundaries_a_shard_crosses(shares: list[float], expected: float) -> None:
    for kind in ("all_gather", "reduce_scatter"):
        assert seconds(kind, "ring", shares, TWO_NODES) == pytest.approx(expected)


def test_comm_model_linearises_at_the_given_shares() -> None:
    model = CommModel(load_cluster(CLUSTER))
    skewed = (0.1 / 3, 0.9, 0.1 / 3, 0.1 / 3)
    nbytes = 2**20
    at_even = model.cost("all_gather", "ring", nbytes).at(skewed)
    exact = model.cost("all_gather", "ring", nbytes, at=skewed).at(skewed)
    alpha, beta = model.alpha_beta("all_gather", "ring")
    assert exact == pytest.approx(3 * alpha + 1.8 * nbytes / beta)
    assert exact >= at_even  # every piece is below the max: the even-share piece underestimates


def _ring_paths(kind: str, monkeypatch: pytest.MonkeyPatch, g: int = 4) -> dict[int, set[frozenset]]:
    """The ring boundaries (pairs of neighbouring members) every block crosses, from the
    runtime's own schedule: each member's calls to exchange recorded, blocks told apart by
    their lengths 1..g."""
    import torch

    from hetsynth.runtime.collectives import gather, ring, scatter
    from hetsynth.runtime.collectives.span import Span

    paths: dict[int, set[frozenset]] = {j: set() for j in range(g)}

    def record(send, recv, span, direction=1):
        if send is not None:
            paths[send.shape[0] - 1].add(frozenset({span.index, (span.index + direction) % g}))

    monkeypatch.setattr(ring, "exchange", record)
    lengths = tuple(range(1, g + 1))
    for i in range(g):
        span = Span(None, tuple(range(g)), i, 0, lengths)
        if kind == "all_gather":
            gather.gather_ring(torch.zeros(lengths[i], 1), span)
        else:
            scatter.scatter_ring(torch.zeros(sum(lengths), 1), span)
    return paths


def test_ring_reduce_scatter_crosses_the_boundaries_of_the_ring_all_gather(monkeypatch) -> None:
    """What the cross-node ring cost assumes of the runtime: block j crosses every boundary of
    the ring but the one just before member j, in the all-gather and the reduce-scatter."""
    g = 4
    gathered, scattered = _ring_paths("all_gather", monkeypatch, g), _ring_paths("reduce_scatter", monkeypatch, g)
    every = {frozenset({k, (k + 1) % g}) for k in range(g)}
    for j in range(g):
        assert gathered[j] == scattered[j] == every - {frozenset({(j - 1) % g, j})}
