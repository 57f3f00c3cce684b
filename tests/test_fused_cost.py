"""The cost of a fused collective-matmul (cost_models.fused), against figures worked by hand
for a ring of 3 members with uneven chunks (1, 2, 3 rows) and unequal devices."""

from __future__ import annotations

import pytest

from cost_models.fused import Ring, ring_cost, sliced_cost
from cost_models.terms import seconds


def ring(gamma: float = 0.0, per_message: float = 0.0) -> Ring:
    """Member e's whole matmul takes (6, 12, 6)[e] s, so a chunk of L rows takes L, 2L, L s;
    a transfer of L rows takes L s (alpha 0, one byte per row at 1 B/s); an add L s."""
    return Ring(member=(0, 1, 2), matmul_s=(6.0, 12.0, 6.0), gamma=(gamma,) * 3, per_message_s=(per_message,) * 3,
                membw=(3.0,) * 3, lengths=((1, 2, 3),) * 3, row_bytes=(1.0,) * 3, alpha=0.0, beta=1.0)


def test_all_gather_matmul_ring_by_hand() -> None:
    """Own chunk first: position s computes chunk (e - s) mod 3, so the members compute
    (1, 4, 3), then (3, 2, 2), then (2, 6, 1) s; steps 1 and 2 bring (3, 1, 2) and (2, 3, 1) s
    of transfer. max(4, 3) + max(3, 3) + 6 = 13 s; the last chunk's compute is exposed."""
    assert seconds(ring_cost(ring(), gather=True)) == pytest.approx(13.0)


def test_matmul_reduce_scatter_ring_by_hand() -> None:
    """Own chunk last: position s computes chunk (e + s + 1) mod 3: (2, 6, 1), (3, 2, 2),
    (1, 4, 3) s; steps bring (3, 1, 2) and (1, 2, 3) s, adds 3 and 3 s.
    6 + (max(3, 3) + 3) + (max(4, 3) + 3) = 19 s."""
    assert seconds(ring_cost(ring(), gather=False)) == pytest.approx(19.0)


def test_transfer_cpu_share_is_charged_to_the_overlapped_compute() -> None:
    """gamma 0.5: the compute branch of step 1 is 4 + 0.5 * 3, of step 2 3 + 0.5 * 3:
    5.5 + 4.5 + 6 = 16 s; a per-message second adds 1 s per step: 18 s."""
    assert seconds(ring_cost(ring(0.5), gather=True)) == pytest.approx(16.0)
    assert seconds(ring_cost(ring(0.5, 1.0), gather=True)) == pytest.approx(18.0)


def test_sliced_by_hand() -> None:
    """k = 2, a slice's collective 2 s, half the matmul (3, 6, 3) s per slice:
    gather: 2 + max(6, 2) + 6 = 14 s; scatter: 6 + max(6, 2) + 2 = 14 s; gamma 0.5: + 1."""
    assert seconds(sliced_cost(ring(), True, 2, 2.0)) == pytest.approx(14.0)
    assert seconds(sliced_cost(ring(), False, 2, 2.0)) == pytest.approx(14.0)
    assert seconds(sliced_cost(ring(0.5), True, 2, 2.0)) == pytest.approx(15.0)


def test_the_choice_flips_to_the_unfused_pair_as_gamma_grows() -> None:
    """The unfused pair: the slowest matmul (12 s) + the all-gather's two steps (3 + 3 s)
    = 18 s. The ring: 13 s at gamma 0, 19 s at gamma 1 (every transfer on the compute)."""
    unfused = 12.0 + 3.0 + 3.0
    assert seconds(ring_cost(ring(0.0), gather=True)) < unfused < seconds(ring_cost(ring(1.0), gather=True))
