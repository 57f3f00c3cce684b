"""The chain bound E of the synthesizer's heuristic (see planner.synthesis).

    extra(c, r)  = compute(c, r) - min_r' compute(c, r')
    out(c, L)    = max over consumers d of c, of min over d's rules r of
                   [ conv(c: L -> r's layout for c) + extra(d, r) + out(d, r's output) ]
                   (0 for a node without consumers, such as the loss)
    E(t, H, k)   = the same max / min for tensor t held in the layouts H, over the
                   consumers of t at index >= k, converting from the cheapest layout in H

`out` is computed on demand and memoised; recursion follows consumers, which have larger
topological indices, so it terminates. A layout from which no consumer rule is reachable
gets an infinite bound (a dead end). E for a tensor held in H is kept as suffix maxima over
its consumers, so a tensor read by every layer (rotary tables, a causal mask) costs one pass
over its consumers per held set, not one per depth.
"""

from __future__ import annotations

import bisect
import sys

from hetsynth.instruction_set.layouts import Layout
from hetsynth.planner.problem import Problem

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
        self._suffix: dict[tuple[str, frozenset[Layout]], list[float]] = {}
        self._options: dict[tuple[str, int], list[tuple[float, tuple[Layout, ...], float, str, Layout]]] = {}
        self._conv: dict[tuple[int, frozenset[Layout], Layout], float] = {}  # by structure id
        self._sid: dict[str, int] = {}
        sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(pb.order) + 1000))

    def bound(self, tensor: str, held: frozenset[Layout], k: int) -> float:
        users = self.consumers.get(tensor, [])
        suffix = self._suffix.get((tensor, held))
        if suffix is None:
            suffix = [0.0] * (len(users) + 1)
            for i in range(len(users) - 1, -1, -1):
                suffix[i] = max(suffix[i + 1], self._via(tensor, held, users[i]))
            self._suffix[(tensor, held)] = suffix
        return suffix[bisect.bisect_left(users, k)]

    def out(self, tensor: str, layout: Layout) -> float:
        key = (tensor, layout)
        if key not in self._out:
            held = frozenset((layout,))
            self._out[key] = max((self._via(tensor, held, j) for j in self.consumers.get(tensor, [])),
                                 default=0.0)
        return self._out[key]

    def _via(self, tensor: str, held: frozenset[Layout], j: int) -> float:
        """min over consumer j's rules of conversion + extra compute + the output's bound.
        Rules come in increasing order of extra + out, a lower bound of their term (a
        conversion costs >= 0 and rounding is monotone), so the first rule whose lower bound
        reaches the best term so far ends the scan with the same minimum."""
        best = INF
        for low, wants, extra, node, output in self._rule_options(tensor, j):
            if low >= best:
                break
            conv = max((self.conversion(tensor, held, w) for w in wants if w not in held), default=0.0)
            if conv != INF:
                best = min(best, conv + extra + self.out(node, output))
        return best

    def _rule_options(self, tensor: str, j: int) -> list[tuple[float, tuple[Layout, ...], float, str, Layout]]:
        """Per rule of consumer j: extra + out (a lower bound), the layouts it wants `tensor`
        in, its extra compute and output; in increasing order of the lower bound."""
        key = (tensor, j)
        if key not in self._options:
            pb, node = self.pb, self.pb.order[j]
            options = []
            for ri, rule in enumerate(pb.rules[node.name]):
                extra = pb.compute_s(node, ri) - self.min_compute[j]
                options.append((extra + self.out(node.name, rule.output), ri,
                                tuple(w for t, w in zip(node.inputs, rule.inputs) if t == tensor),
                                extra, node.name, rule.output))
            options.sort(key=lambda o: o[:2])
            self._options[key] = [(o[0], *o[2:]) for o in options]
        return self._options[key]

    def conversion(self, tensor: str, held: frozenset[Layout], want: Layout) -> float:
        """Cheapest conversion from a held layout; shared by tensors of the same structure,
        as Problem.conversion is."""
        sid = self._sid.get(tensor)
        if sid is None:
            sid = self._sid[tensor] = self.pb.structure_id(tensor)
        key = (sid, held, want)
        cost = self._conv.get(key)
        if cost is None:
            costs = [sum(s.cost_s for s in p) for p in (self.pb.conversion(tensor, h, want) for h in held)
                     if p is not None]
            cost = self._conv[key] = min(costs, default=INF)
        return cost
