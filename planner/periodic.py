"""Repeated blocks of the search order, and the renaming that carries a search state from one
block to another (planner.synthesis searches such a run of blocks block by block and reuses
one block's search wherever its start is the same up to this renaming).

Blocks. A block is the set of call nodes whose module path names one element of a
`ModuleList` / `Sequential` (instruction_set.blocks.block_of), with the nodes of no block that
follow it up to the next block (a model's loop may add up an auxiliary loss between blocks).
A *run* is a sequence of blocks B_t, B_{t+1}, ..., B_{t+P-1}, each contiguous in the search
order, that follow each other at a fixed period (block j occupies [b_j, b_j + L),
b_{j+1} = b_j + L) and each equal to the *template* B_t:

- node i of B_j has the structural signature of node i of B_t (op, arguments, shapes, FLOPs,
  per input its kind, dim classes, batch dims, liveness and forced layout:
  planner.signature) and the same compute cost under every rule (so measured op times
  count too);
- the map tau_j: (tensor of B_j) -> (tensor of B_t), node i's output to node i's output and
  node i's p-th input to node i's p-th input, is a function, injective, and the identity on
  every tensor produced outside the run and read outside B_j (all blocks read the same mask
  and rotary tables), while B_j's own parameters map to B_t's and a tensor produced inside
  the run may map to one outside it (B_j reads B_{j-1}'s output where B_t reads what
  precedes the run).

Translation. A search state (k, F) at the start of B_j (k = b_j) or its end (k = b_j + L)
is carried to the same place of B_t by renaming each fact's tensor with tau_j, and back with
its inverse; a tensor outside the map stays itself if it is produced outside the run and
makes the state untranslatable (None) otherwise. Equal signatures give equal rules, costs
and liveness, so the transitions from the translated state are those from the original,
renamed (the memo of planner.synthesis already relies on this for single nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hetsynth.instruction_set.blocks import block_of
from hetsynth.planner.problem import Problem
from hetsynth.planner.signature import Signatures

MIN_RUN = 8  # fewer repeated blocks are searched whole: the per-block searches would not pay


@dataclass(frozen=True)
class Run:
    """P blocks of L nodes from `first`; maps[q] = tau for block q of the run (maps[0] = {})."""

    first: int
    length: int
    maps: tuple[dict[str, str], ...]
    inverse: tuple[dict[str, str], ...]

    @property
    def blocks(self) -> int:
        return len(self.maps)

    @property
    def end(self) -> int:
        return self.first + self.length * self.blocks

    def start(self, q: int) -> int:
        return self.first + q * self.length

    @property
    def inside(self) -> range:
        return range(self.first, self.end)

    def to_template(self, q: int) -> tuple[dict[str, str], dict[str, str]] | None:
        """(tau_q, its inverse): block q's names to the template's (None for the template)."""
        return (self.maps[q], self.inverse[q]) if q else None

    def from_template(self, q: int) -> tuple[dict[str, str], dict[str, str]] | None:
        return (self.inverse[q], self.maps[q]) if q else None


def _block_ranges(pb: Problem) -> list[tuple[int, int]]:
    """[start, end) of each block whose nodes are contiguous in the search order."""
    names = [block_of(n) for n in pb.order]
    ranges: dict[str, list[int]] = {}
    for k, name in enumerate(names):
        if name is not None:
            ranges.setdefault(name, []).append(k)
    out = [(ks[0], ks[-1] + 1) for ks in ranges.values() if ks[-1] - ks[0] + 1 == len(ks)]
    return sorted(out)


def _costs(pb: Problem, k: int) -> tuple[float, ...]:
    node = pb.order[k]
    return tuple(pb.compute_s(node, ri) for ri in range(len(pb.rules[node.name])))


def _tau(pb: Problem, sig: Signatures, t: int, j: int, length: int, inside: range) -> dict[str, str] | None:
    """tau from the block at j to the template at t, or None when the two differ."""
    tau: dict[str, str] = {}
    for i in range(length):
        a, b = pb.order[j + i], pb.order[t + i]
        if sig.of(j + i) != sig.of(t + i) or _costs(pb, j + i) != _costs(pb, t + i):
            return None
        for x, y in zip((a.name, *a.inputs), (b.name, *b.inputs)):
            if tau.setdefault(x, y) != y:
                return None
    if len(set(tau.values())) != len(tau):
        return None
    block = range(j, j + length)
    local = lambda x: pb.index.get(x, -1) in inside or (
        x not in pb.index and all(pb.index[c] in block for c in pb.graph.consumers.get(x, ())))
    if any(x != y and not local(x) for x, y in tau.items()):
        return None  # an outer tensor read in place of another: not the same block
    return tau


def find_run(pb: Problem, sig: Signatures, min_run: int | None = None) -> Run | None:
    """The longest run of at least `min_run` (default MIN_RUN) blocks equal to their first
    (see the module docstring), or None."""
    min_run = MIN_RUN if min_run is None else min_run
    ranges = _block_ranges(pb)
    best: Run | None = None
    a = 0
    while a < len(ranges):
        start, end = ranges[a]
        # the period: the block and the nodes of no block up to the next one (an auxiliary loss
        # added up between MoE blocks), compared node for node like the block's own
        length = ranges[a + 1][0] - start if a + 1 < len(ranges) else end - start
        maps: list[dict[str, str]] = [{}]
        for start_j, end_j in ranges[a + 1:]:
            if (start_j != start + length * len(maps) or end_j - start_j != end - start
                    or start_j + length > len(pb.order)):
                break
            inside = range(start, start_j + length)
            tau = _tau(pb, sig, start, start_j, length, inside)
            if tau is None:
                break
            maps.append(tau)
        if len(maps) >= min_run and (best is None or len(maps) > best.blocks):
            best = Run(start, length, tuple(maps), tuple({v: k for k, v in m.items()} for m in maps))
        a += len(maps)  # a block equal to this template starts no longer run of its own
    return best


def translate(facts: Sequence[tuple[str, object]], mapping: dict[str, str], inverse: dict[str, str], inside: range,
              index: dict[str, int]) -> list[tuple[str, object]] | None:
    """The facts renamed by `mapping` (`inverse`: its inverse); None when a tensor produced
    inside the run is not in it, or when a tensor kept as itself is also what another is
    renamed to (a loss reading the embedding and every block's output: B_1's input maps onto
    the embedding, which the state also holds), so that two tensors' facts would merge."""
    out = []
    for tensor, layout in facts:
        renamed = mapping.get(tensor)
        if renamed is None:
            if index.get(tensor, -1) in inside or tensor in inverse:
                return None
            renamed = tensor
        out.append((renamed, layout))
    return out


__all__ = ["MIN_RUN", "Run", "find_run", "translate"]
