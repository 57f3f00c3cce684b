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

Each device runs its own pipeline (a chunk is forwarded as soon as it is here; with uneven
chunks the devices' steps differ, so a bulk-synchronous max per step would overestimate), and
the instruction ends with the slowest device:

    all-gather -> matmul  T_e = sum_{s=1}^{g-1} max(t_c(e,s-1) + x(e,s), t_p(e,s))  +  t_c(e,g-1)
                          (the own chunk's compute under step 1; the last chunk's after the ring)
    matmul -> RS          T_e = t_c(e,0) + sum_{s=1}^{g-1} [ max(t_c(e,s) + x(e,s), t_p(e,s)) + t_add(e,s) ]
                          (t_add = 3 r L_j / membw_e: read two, write one)
    time = max_e T_e

that is the issue's "first chunk's compute + sum over steps of max(t_c, t_p) (+ the adds)",
mirrored for the all-gather. k-slicing runs one collective per slice: with A the collective of
one slice (a padded collective of 1/k of the bytes, k latencies in all) and C_e = c_e / k,

    all-gather -> matmul  T_e = A + (k-1) max(C_e + gamma A + m, A) + C_e
    matmul -> RS          T_e = C_e + (k-1) max(C_e + gamma A + m, A) + A

(the head, or the tail, of 1/k stays exposed). The result is an Overlap of per-device compute
(a compute Form) and T (a communication Form): its time is max_e T_e, its exposed
communication max_e T_e - max_e compute_e. Everything here is a constant in the sharding
ratios (FIXED: the fused forms are evaluated at the current ratios and enter the LP as numbers,
as the issue allows); exact in r would need each chunk's share by member (a permutation of
the shares), left for later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hetsynth.cost_models.linear_cost import LinearCost
from hetsynth.cost_models.terms import Cost, Form, Overlap, Shares, ShareKind
from hetsynth.instruction_set.kinds import Category


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


def pipeline(first: Sequence[float], steps: Sequence[tuple[Sequence[float], Sequence[float], Sequence[float]]],
             last: Sequence[float], ring: Ring) -> Overlap:
    """Per entry e: T_e = first_e + sum over steps of max(c_e + x_e, p_e) + after_e + last_e, with
    x_e = gamma_e p_e + m_e (module docstring), each (c, p, after) of a step; as the Overlap of
    the entries' compute (every c, x, after, first and last) and their T (communication), so that
    the time is max_e T_e and the exposed communication max_e T_e - max_e compute_e."""
    total, busy = list(first), list(first)
    for c, p, after in steps:
        for e in range(ring.n):
            x = ring.gamma[e] * p[e] + (ring.per_message_s[e] if p[e] > 0 else 0.0)
            total[e] += max(c[e] + x, p[e]) + after[e]
            busy[e] += c[e] + x + after[e]
    for e in range(ring.n):
        total[e] += last[e]
        busy[e] += last[e]
    return Overlap((form(busy, Category.COMPUTE), form(total, Category.COMMUNICATION)))


def ring_cost(ring: Ring, gather: bool) -> Cost:
    """The fused ring's time (module docstring); `gather`: all-gather -> matmul, else
    matmul -> reduce-scatter."""
    g, n = ring.size, ring.n
    tc = [[ring.matmul_s[e] * ring.fraction(e, ring.chunk(e, s, gather)) for e in range(n)] for s in range(g)]
    tp = [[ring.transfer_s(e, ring.chunk(e, s, gather)) for e in range(n)] for s in range(g)]
    zero = [0.0] * n
    if gather:
        return pipeline(zero, [(tc[s - 1], tp[s], zero) for s in range(1, g)], tc[g - 1], ring)
    adds = [[3 * ring.row_bytes[e] * ring.lengths[e][ring.chunk(e, s, False)] / ring.membw[e] for e in range(n)]
            for s in range(g)]
    return pipeline(tc[0], [(tc[s], tp[s], adds[s]) for s in range(1, g)], zero, ring)


def sliced_cost(ring: Ring, gather: bool, k: int, collective_s: float) -> Cost:
    """k-slicing's time (module docstring; the same sum for both kinds); `collective_s`: one
    slice's padded collective."""
    c = [m / k for m in ring.matmul_s]
    zero = [0.0] * ring.n
    busy, total = pipeline(zero, [(c, [collective_s] * ring.n, zero)] * (k - 1), c, ring).parts
    assert isinstance(total, Form)
    return Overlap((busy, form([t + collective_s for t in total.cost.a], Category.COMMUNICATION)))


__all__ = ["Ring", "form", "pipeline", "ring_cost", "sliced_cost"]
