"""Cost of a linear fused with the collective feeding it (all-gather -> matmul) or fed by it
(matmul -> reduce-scatter): the CommFuse ring and k-slicing (runtime.collectives.fused), as
composed cost terms (cost_models.terms), per entry e of the cost vectors.

A ring of g members; member m's chunk has L_m rows (L = sum). Device e computes, at ring
position s, the chunk j_e(s) (all-gather: own first, j = m_e - s; reduce-scatter: furthest
first, own last, j = m_e + s + 1), and receives at step s the chunk the ring moves into it:

    t_c(e, s) = c_e L_j / L              (c_e: the device's seconds for the whole local matmul)
    t_p(e, s) = alpha + r L_j / beta     (r: bytes per row; 0 for an empty chunk: skipped)
    x(e, s)   = gamma_e t_p(e, s) + m_e  (the compute the transfer in flight takes: the
                                          measured transfer CPU share and per-message cost)

Every step waits for the slowest member (bulk-synchronous), so a step is an Overlap of per-entry
forms, max(max_e (t_c + x), max_e t_p):

    all-gather -> matmul  sum_{s=1}^{g-1} Overlap(t_c(s-1) + x(s), t_p(s))  +  t_c(g-1)
                          (the own chunk's compute under step 1; the last chunk's after the ring)
    matmul -> RS          t_c(0) + sum_{s=1}^{g-1} [ Overlap(t_c(s) + x(s), t_p(s)) + t_add(s) ]
                          (t_add = 3 r L_j / membw_e: read two, write one)

that is the issue's "first chunk's compute + sum over steps of max(t_c, t_p) (+ the adds)",
mirrored for the all-gather. k-slicing runs one collective per slice: with A_t the collective of
slice t (a padded collective of the slice's bytes, k latencies in all) and C_t its matmul,

    all-gather -> matmul  A_1 + sum_{t=2}^{k} Overlap(C_{t-1} + gamma A_t + m, A_t) + C_k
    matmul -> RS          C_1 + sum_{t=2}^{k} Overlap(C_t + gamma A_{t-1} + m, A_{t-1}) + A_k

(the head, or the tail, of 1/k stays exposed). Everything here is a constant in the sharding
ratios (FIXED: the fused forms are evaluated at the current ratios and enter the LP as numbers,
as the issue allows); exact in r would need each chunk's share by member (a permutation of
the shares), left for later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from cost_models.linear_cost import LinearCost
from cost_models.terms import Cost, Form, Overlap, Series, Shares, ShareKind
from instruction_set.kinds import Category


@dataclass(frozen=True)
class Ring:
    """What the cost of one fused instruction needs, per entry e: its member index in its
    group, the seconds of its whole local matmul, its transfer CPU share and per-message
    seconds, its memory bandwidth; and the group's chunk lengths, bytes per row and link."""

    member: tuple[int, ...]
    matmul_s: tuple[float, ...]
    gamma: tuple[float, ...]
    per_message_s: tuple[float, ...]
    membw: tuple[float, ...]
    lengths: tuple[tuple[int, ...], ...]  # per entry: its group's chunk lengths
    row_bytes: tuple[float, ...]
    alpha: float
    beta: float

    @property
    def size(self) -> int:
        return len(self.lengths[0])

    @property
    def n(self) -> int:
        return len(self.member)

    def chunk(self, e: int, s: int, gather: bool) -> int:
        m, g = self.member[e], self.size
        return (m - s) % g if gather else (m + s + 1) % g

    def fraction(self, e: int, j: int) -> float:
        total = sum(self.lengths[e])
        return self.lengths[e][j] / total if total else 0.0

    def transfer_s(self, e: int, j: int) -> float:
        rows = self.lengths[e][j]
        return self.alpha + self.row_bytes[e] * rows / self.beta if rows else 0.0


def form(values: Sequence[float], category: Category) -> Form:
    """A constant per entry (max over entries)."""
    n = len(values)
    return Form(LinearCost(tuple(values), (0.0,) * n), Shares((1.0,) * n, ShareKind.NONE), category)


def _overlap(compute: Sequence[float], transfer: Sequence[float], ring: Ring) -> Overlap:
    lost = [g * t + (m if t > 0 else 0.0) for g, m, t in zip(ring.gamma, ring.per_message_s, transfer)]
    return Overlap((Series((form(compute, Category.COMPUTE), form(lost, Category.COMPUTE))),
                    form(transfer, Category.COMMUNICATION)))


def ring_cost(ring: Ring, gather: bool) -> Cost:
    """The fused ring's time (module docstring); `gather`: all-gather -> matmul, else
    matmul -> reduce-scatter."""
    g, n = ring.size, ring.n
    tc = [[ring.matmul_s[e] * ring.fraction(e, ring.chunk(e, s, gather)) for e in range(n)] for s in range(g)]
    tp = [[ring.transfer_s(e, ring.chunk(e, s, gather)) for e in range(n)] for s in range(g)]
    if gather:
        steps: list[Cost] = [_overlap(tc[s - 1], tp[s], ring) for s in range(1, g)]
        return Series((*steps, form(tc[g - 1], Category.COMPUTE)))
    parts: list[Cost] = [form(tc[0], Category.COMPUTE)]
    for s in range(1, g):
        adds = [3 * ring.row_bytes[e] * ring.lengths[e][ring.chunk(e, s, False)] / ring.membw[e] for e in range(n)]
        parts += [_overlap(tc[s], tp[s], ring), form(adds, Category.COMPUTE)]
    return Series(tuple(parts))


def sliced_cost(ring: Ring, gather: bool, k: int, collective_s: float) -> Cost:
    """k-slicing's time (module docstring); `collective_s`: one slice's padded collective."""
    c = [m / k for m in ring.matmul_s]
    a = [collective_s] * ring.n
    steps: list[Cost] = [_overlap(c, a, ring) for _ in range(k - 1)]
    head, tail = (form(a, Category.COMMUNICATION), form(c, Category.COMPUTE))
    return Series((head, *steps, tail) if gather else (tail, *steps, head))


__all__ = ["Ring", "form", "ring_cost", "sliced_cost"]
