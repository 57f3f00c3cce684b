"""The cost of a fused collective-matmul (cost_models.fused), against figures worked by hand
for a ring of 3 members with uneven chunks (1, 2, 3 rows) and unequal devices."""

from __future__ import annotations

import pytest

from hetsynth.cost_models.fused import Ring, ring_cost, sliced_cost
from hetsynth.cost_models.terms import seconds


def ring(gamma: float = 0.0, per_message: float = 0.0) -> Ring:
    """Member e's whole matmul takes (6, 12, 6)[e] s, so a chunk of L rows takes L, 2L, L s;
    a transfer of L rows takes L s (alpha 0, one byte per row at 1 B/s); an add L s."""
    return Ring(member=(0, 1, 2), matmul_s=(6.0, 12.0, 6.0), gamma=(gamma,) * 3, per_message_s=(per_message,) * 3,
                membw=(3.0,) * 3, lengths=((1, 2, 3),) * 3, row_bytes=(1.0,) * 3, alpha=0.0, beta=1.0)


def test_all_gather_matmul_ring_by_hand() -> None:
    """Own chunk first: position s computes chunk (e - s) mod 3, so the members compute
    (1, 4, 3), then (3, 2, 2), then (2, 6, 1) s; steps 1 and 2 bring (3, 1, 2) and (2, 3, 1) s
    of transfer. Member 0: max(1, 3) + max(3, 2) + 2 = 8; member 1: max(4, 1) + max(2, 3) + 6
    = 13; member 2: max(3, 2) + max(2, 1) + 1 = 6: 13 s (the last chunk's compute is exposed)."""
    assert seconds(ring_cost(ring(), gather=True)) == pytest.approx(13.0)


def test_matmul_reduce_scatter_ring_by_hand() -> None:
    """Own chunk last: position s computes chunk (e + s + 1) mod 3: (2, 6, 1), (3, 2, 2),
    (1, 4, 3) s; steps bring (3, 1, 2) and (1, 2, 3) s, adds as many seconds as rows arrive.
    Member 0: 2 + (max(3, 3) + 3) + (max(1, 1) + 1) = 10; member 1: 6 + (max(2, 1) + 1) +
    (max(4, 2) + 2) = 15; member 2: 1 + (max(2, 2) + 2) + (max(3, 3) + 3) = 11: 15 s."""
    assert seconds(ring_cost(ring(), gather=False)) == pytest.approx(15.0)


def test_transfer_cpu_share_is_charged_to_the_overlapped_compute() -> None:
    """gamma 0.5, member 1 (the slowest): max(4 + 0.5, 1) + max(2 + 1.5, 3) + 6 = 14 s; a
    per-message second more on each step: max(5.5, 1) + max(4.5, 3) + 6 = 16 s."""
    assert seconds(ring_cost(ring(0.5), gather=True)) == pytest.approx(14.0)
    assert seconds(ring_cost(ring(0.5, 1.0), gather=True)) == pytest.approx(16.0)


def test_sliced_by_hand() -> None:
    """k = 2, a slice's collective 2 s, half the matmul (3, 6, 3) s per slice:
    gather: 2 + max(6, 2) + 6 = 14 s; scatter: 6 + max(6, 2) + 2 = 14 s; gamma 0.5: + 1."""
    assert seconds(sliced_cost(ring(), True, 2, 2.0)) == pytest.approx(14.0)
    assert seconds(sliced_cost(ring(), False, 2, 2.0)) == pytest.approx(14.0)
    assert seconds(sliced_cost(ring(0.5), True, 2, 2.0)) == pytest.approx(15.0)


def test_the_choice_flips_to_the_unfused_pair_as_the_transfer_cpu_grows() -> None:
    """The unfused pair: the slowest matmul (12 s) + the all-gather's two steps (3 + 3 s)
    = 18 s. The ring: 13 s free of transfer CPU; with every transfer on the compute (gamma 1)
    and 2 s per message, member 1: max(4 + 1 + 2, 1) + max(2 + 3 + 2, 3) + 6 = 20 s."""
    unfused = 12.0 + 3.0 + 3.0
    assert seconds(ring_cost(ring(0.0), gather=True)) < unfused < seconds(ring_cost(ring(1.0, 2.0), gather=True))
