"""Communication fused with the matmul it feeds (CommFuse): the all-gather S(d) -> R before a
matmul and the reduce-scatter P -> S(d) after one, decomposed into their g-1 ring steps on
asynchronous point-to-point so that every transfer runs under a partial matmul.

Tensors are in "front" layout: the chunk dim is dim 0 of every operand and result (callers
move it there, runtime.collectives.span.to_front). Member j of the span owns rows
[o_j, o_j + L_j) (lengths uneven, possibly 0; every rank knows all of them, so an empty
transfer is skipped on both ends).

AG -> matmul, ring, own chunk first (rank i of g, `compute(j, start, rows, out)` writes the
output of rows [start, start + len) of chunk j into out, their rows of the caller's output;
the ring passes whole chunks, start 0, and receives each into its rows of the gathered x):

    post step 1 (send x_i to i+1, receive x_{i-1} from i-1);  y_i = compute(i, x_i)
    for s = 1..g-1:  wait step s;  post step s+1 (forward x_{i-s}, receive x_{i-s-1});
                     y_{i-s} = compute(i-s, x_{i-s})
    time ~ t_c(i) + sum_s max(t_c(i-s), t_p(s)): no tail.

matmul -> RS, ring, own chunk last (`part(j)` makes this rank's summand of output chunk j); the
ring runs the other way round (as runtime.collectives.scatter.scatter_ring), chunk j starting
at member j+1 and travelling g-1 hops to j:

    order_s = (i + s + 1) mod g  (s = 0..g-1; order_{g-1} = i)
    acc = part(order_0);  post (send acc to i-1, receive buf from i+1)
    for s = 1..g-1:  z = part(order_s);  wait;  acc = z += buf;  post the next step (s < g-1)
    return acc                    = sum over members of their summand of chunk i

k-slice baseline (`sliced`): every chunk split into k parts by largest remainder; slice t is
one padded all_gather_single (resp. reduce_scatter_single) of every member's part t, async,
overlapped with the matmul of slice t-1 (resp. t+1); slices empty on every member are skipped.

Each point-to-point or collective work is waited exactly once (a second wait on a gloo
point-to-point work can hang). Written by us: torch's async TP (torch.distributed
._symmetric_memory) is CUDA only, for equal shards on symmetric memory.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from hetsynth.instruction_set.shards import largest_remainder
from hetsynth.runtime.collectives import ring
from hetsynth.runtime.collectives.span import Span, pad_rows

Compute = Callable[[int, int, torch.Tensor, torch.Tensor], None]
# (member j, first row in x_j, rows, out): writes the output of those rows into `out` (a view
# of the caller's output with as many rows), so that no chunk's result is copied again
Part = Callable[[int], torch.Tensor]  # member j -> this rank's summand of chunk j, a new tensor (added into)


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def ag_matmul_ring(x: torch.Tensor, span: Span, compute: Compute, y: torch.Tensor) -> torch.Tensor:
    """The gathered x, with y (sum of the lengths rows, front layout) written chunk by chunk:
    the ring above, own chunk first. Every chunk is received straight into its rows of the
    gathered x (no concatenation afterwards), and the own rows are copied there by the poster
    thread while the own chunk is multiplied (ring.copy_beside: on a GPU, the copy engine's
    work). Every step is posted from the poster thread (ring.post_beside)."""
    g, i = span.size, span.index
    x = x.contiguous()
    full = x.new_empty(sum(span.lengths), *x.shape[1:])
    blocks = [full.narrow(0, span.offset(j), n) for j, n in enumerate(span.lengths)]
    works = [ring.post_beside(x, blocks[(i - 1) % g], span, 1)] if g > 1 else []
    own = ring.copy_beside(blocks[i], x)
    compute(i, 0, x, y.narrow(0, span.offset(i), span.lengths[i]))
    for s in range(1, g):
        _wait(works)
        j = (i - s) % g
        works = [ring.post_beside(blocks[j], blocks[(j - 1) % g], span, 1)] if s < g - 1 else []
        compute(j, 0, blocks[j], y.narrow(0, span.offset(j), span.lengths[j]))
    own.wait()
    return full


def matmul_rs_ring(span: Span, part: Part) -> torch.Tensor:
    """This rank's chunk of the sum over members of part(·): the ring above, own chunk last;
    the received partial sum is added into the new summand in place, one receive buffer."""
    g, i = span.size, span.index
    order = [(i + s + 1) % g for s in range(g)]
    acc = part(order[0]).contiguous()
    received = acc.new_empty(max(span.lengths), *acc.shape[1:]) if g > 1 else acc
    for s in range(1, g):
        buf = received.narrow(0, 0, span.lengths[order[s]])
        works = [ring.post_beside(acc, buf, span, -1)]
        z = part(order[s])
        _wait(works)
        acc = z.add_(buf).contiguous()
    return acc


def _slices(span: Span, k: int) -> list[list[int]]:
    """parts[j][t]: rows of member j's part t."""
    return [largest_remainder([1.0] * k, n) for n in span.lengths]


def ag_matmul_sliced(x: torch.Tensor, span: Span, compute: Compute, k: int, y: torch.Tensor) -> torch.Tensor:
    """k-slice baseline of ag_matmul_ring (same results, y written, the gathered x returned):
    slice t's all-gather in flight while slice t-1's rows are multiplied."""
    parts = _slices(span, k)
    rows = [max(p[t] for p in parts) for t in range(k)]
    steps = [t for t in range(k) if rows[t] > 0]
    offsets = [[span.offset(j) + sum(p[:t]) for t in range(k)] for j, p in enumerate(parts)]
    mine = x.contiguous()
    full = x.new_empty(sum(span.lengths), *x.shape[1:])

    def post(t: int) -> tuple[Any, torch.Tensor]:
        start = offsets[span.index][t] - span.offset(span.index)
        piece = pad_rows(mine.narrow(0, start, parts[span.index][t]), rows[t])
        out = x.new_empty(span.size * rows[t], *x.shape[1:])
        return dist.all_gather_single(out, piece.contiguous(), group=span.group, async_op=True), out

    pending = post(steps[0]) if steps else None
    for n, t in enumerate(steps):
        work, out = pending  # type: ignore[misc]
        work.wait()
        pending = post(steps[n + 1]) if n + 1 < len(steps) else None
        for j in range(span.size):
            at = offsets[j][t]
            got = full.narrow(0, at, parts[j][t])
            got.copy_(out.narrow(0, j * rows[t], parts[j][t]))
            compute(j, at - span.offset(j), got, y.narrow(0, at, parts[j][t]))
    return full


def matmul_rs_sliced(span: Span, part_rows: Callable[[int, int, int], torch.Tensor], k: int) -> torch.Tensor:
    """k-slice baseline of matmul_rs_ring: for slice t, this rank's summands of every member's
    part t (`part_rows(j, start, rows)`: rows [start, start+rows) of chunk j's summand), padded
    and reduce-scattered async while slice t+1's partials are computed."""
    parts = _slices(span, k)
    rows = [max(p[t] for p in parts) for t in range(k)]
    offsets = [[sum(p[:t]) for t in range(k)] for p in parts]
    works, outs = [], []
    for t in (t for t in range(k) if rows[t] > 0):
        summand = torch.cat([pad_rows(part_rows(j, offsets[j][t], parts[j][t]), rows[t])
                             for j in range(span.size)]).contiguous()
        out = summand.new_empty(rows[t], *summand.shape[1:])
        works.append(dist.reduce_scatter_single(out, summand, op=dist.ReduceOp.SUM, group=span.group,
                                                async_op=True))
        outs.append(out[:parts[span.index][t]])
    _wait(works)
    if not outs:
        return part_rows(span.index, 0, 0)
    return torch.cat(outs)

