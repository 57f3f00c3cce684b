"""The chain bound E of the synthesizer's heuristic (see planner.synthesis).

    extra(c, r)  = compute(c, r) - min_r' compute(c, r')
    out(c, L)    = max over consumers d of c, of min over d's rules r of
                   [ conv(c: L -> r's layout for c) + extra(d, r) + out(d, r's output) ]
                   (0 for a node without consumers, such as the loss)
    E(t, H, k)   = the same max / min for tensor t held in the layouts H, over the
                   consumers of t at index >= k, converting from the cheapest layout in H

`out` is computed on demand and memoised; recursion follows consumers, which have larger
topological indices, so it terminates. A layout from which no consumer rule is reachable
gets an infinite bound (a dead end).
"""

from __future__ import annotations

import bisect
import sys

from instruction_set.layouts import Layout
from planner.problem import Problem

INF = float("inf")


class ChainBound:
    def __init__(self, pb: Problem) -> None:
        self.pb = pb
        self.consumers: dict[str, list[int]] = {}
        for k, node in enumerate(pb.order):
            for t in set(node.inputs):
                self.consumers.setdefault(t, []).append(k)
        self.min_compute = [min(pb.compute_s(n, ri) for ri in range(len(pb.rules[n.name])))
                            for n in pb.order]
        self._out: dict[tuple[str, Layout], float] = {}
        self._held: dict[tuple[str, frozenset[Layout], int], float] = {}
        sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(pb.order) + 1000))

    def bound(self, tensor: str, held: frozenset[Layout], k: int) -> float:
        users = self.consumers.get(tensor, [])
        first = bisect.bisect_left(users, k)
        key = (tensor, held, first)
        if key not in self._held:
            self._held[key] = max((self._via(tensor, held, j) for j in users[first:]), default=0.0)
        return self._held[key]

    def out(self, tensor: str, layout: Layout) -> float:
        key = (tensor, layout)
        if key not in self._out:
            held = frozenset((layout,))
            self._out[key] = max((self._via(tensor, held, j) for j in self.consumers.get(tensor, [])),
                                 default=0.0)
        return self._out[key]

    def _via(self, tensor: str, held: frozenset[Layout], j: int) -> float:
        """min over consumer j's rules of conversion + extra compute + the output's bound."""
        pb = self.pb
        node = pb.order[j]
        best = INF
        for ri, rule in enumerate(pb.rules[node.name]):
            conv = 0.0
            for t, want in zip(node.inputs, rule.inputs):
                if t == tensor and want not in held:
                    conv = max(conv, self._conversion(tensor, held, want))
            if conv == INF:
                continue
            extra = pb.compute_s(node, ri) - self.min_compute[j]
            best = min(best, conv + extra + self.out(node.name, rule.output))
        return best

    def _conversion(self, tensor: str, held: frozenset[Layout], want: Layout) -> float:
        costs = [sum(s.cost_s for s in p) for p in (self.pb.conversion(tensor, h, want) for h in held)
                 if p is not None]
        return min(costs, default=INF)
