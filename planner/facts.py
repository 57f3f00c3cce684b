"""The synthesizer's fact table: integer ids of layout facts `(tensor, layout)`, and the
step from a state's facts to its successor's (planner.synthesis).

A state holds a frozenset of fact ids, *pruned*: without a fact (t, L) that follows at no
cost from (t, R) (a local slice) when (t, R) is held too, since a consumer re-derives it for
free. The successor of facts F by a move adding facts B at node k is

    prune((F | B) - dead(k))

where dead(k) are the facts of tensors read for the last time at k (or never read). F is
pruned, and removing every fact of a tensor creates no new (free, R) pair, so a pair to prune
has a member in B: a free fact of B whose R fact is held, or the held free facts of a tensor
whose R fact is in B. `join` checks only those, in O(|B|) instead of O(|F|). F - dead(k) is
taken once per expanded state and B - dead(k) once per move; the facts of dead(k), and of
each node's inputs, are kept per node as ids are handed out.
"""

from __future__ import annotations

from hetsynth.instruction_set.layouts import R, Layout
from hetsynth.planner.problem import Problem
from hetsynth.planner.transitions import Fact


class FactTable:
    """Integer ids of layout facts, each id's tensor, and tensors dying at each node."""

    def __init__(self, pb: Problem) -> None:
        self.pb = pb
        self.id: dict[Fact, int] = {}
        self.facts: list[Fact] = []
        self.tensor: list[str] = []
        self.free: list[bool] = []        # (t, L) follows from (t, R) at no cost (a local slice)
        self.r_id: dict[str, int] = {}    # tensor -> id of its R fact
        self.ids_of: dict[str, list[int]] = {}   # tensor -> ids of its facts
        self.free_of: dict[str, list[int]] = {}  # tensor -> ids of its free facts
        dead: list[list[str]] = [[] for _ in pb.order]
        for tensor, k in pb.last_use.items():
            if k < len(pb.order):
                dead[k].append(tensor)
        for k, node in enumerate(pb.order):
            if node.name not in pb.last_use:
                dead[k].append(node.name)  # computed but never read
        self.dead_after = [tuple(d) for d in dead]
        self.dies_at = {t: k for k, ts in enumerate(dead) for t in ts}
        self.dead_ids: list[set[int]] = [set() for _ in pb.order]  # ids of the facts of dead_after[k]
        self.readers: dict[str, list[int]] = {}
        for k, node in enumerate(pb.order):
            for t in dict.fromkeys(node.inputs):
                self.readers.setdefault(t, []).append(k)
        self.input_ids: list[set[int]] = [set() for _ in pb.order]  # ids of the facts of node k's inputs

    def encode(self, facts: frozenset[Fact]) -> frozenset[int]:
        return frozenset(self.id[f] if f in self.id else self._new(f) for f in facts)

    def _new(self, fact: Fact) -> int:
        i = self.id[fact] = len(self.facts)
        tensor, layout = fact
        self.facts.append(fact)
        self.tensor.append(tensor)
        self.free.append(layout != R and self._free_from_r(tensor, layout))
        self.ids_of.setdefault(tensor, []).append(i)
        if self.free[i]:
            self.free_of.setdefault(tensor, []).append(i)
        if layout == R:
            self.r_id[tensor] = i
        k = self.dies_at.get(tensor)
        if k is not None:
            self.dead_ids[k].add(i)
        for j in self.readers.get(tensor, ()):
            self.input_ids[j].add(i)
        return i

    def _free_from_r(self, tensor: str, layout: Layout) -> bool:
        steps = self.pb.conversion(tensor, R, layout)
        return steps is not None and all(s.cost_s == 0.0 for s in steps)

    def live(self, ids: frozenset[int], k: int) -> frozenset[int]:
        """The facts still live after node k: without those of tensors it reads last."""
        return ids.difference(self.dead_ids[k])

    def live_added(self, added: frozenset[int], k: int) -> frozenset[int]:
        """`live` of the facts a move at node k adds (fixed per move, so memoised by the caller)."""
        return frozenset(i for i in added if self.dies_at.get(self.tensor[i]) != k)

    def checks(self, added: frozenset[int]) -> tuple[tuple[int, str, bool], ...]:
        """(id, tensor, free) of the facts in `added` that may form a pair to prune: the free
        ones and the R ones (fixed per fact, so kept by the caller with `added`)."""
        return tuple((i, self.tensor[i], self.free[i]) for i in added
                     if self.free[i] or self.facts[i][1] == R)

    def join(self, live: frozenset[int], added: frozenset[int], checks: tuple) -> frozenset[int]:
        """prune(live | added) for pruned `live` and `added` = live_added(...) with its
        `checks` (see the module docstring): the successor's facts."""
        out = live | added
        if not checks:
            return out
        implied, r_id = [], self.r_id
        for i, t, free in checks:
            if free:
                if r_id.get(t) in out:
                    implied.append(i)
            else:
                implied += [j for j in self.free_of.get(t, ()) if j in out]
        return out.difference(implied) if implied else out

    def inputs(self, ids: frozenset[int], k: int) -> frozenset[int]:
        """The facts about node k's inputs."""
        return ids.intersection(self.input_ids[k])

    def decode(self, ids: frozenset[int]) -> frozenset[Fact]:
        return frozenset(self.facts[i] for i in ids)

    def restrict(self, ids: frozenset[int], tensors: frozenset[str]) -> frozenset[int]:
        """The facts about these tensors (scanning the smaller side)."""
        if len(tensors) >= len(ids):
            return frozenset(i for i in ids if self.tensor[i] in tensors)
        return ids.intersection([i for t in tensors for i in self.ids_of.get(t, ())])
