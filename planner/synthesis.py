"""A* synthesis of a distributed program (after HAP, EuroSys'24, with a better search).

Problem. Given the reference graph's call nodes v_0 .. v_{N-1} in topological order, find
the cheapest sequence of instructions that computes every node (each under one sharding
rule) and makes every rule's inputs available in the layouts it needs. Cost is the predicted
seconds of one training step (forward and backward) at fixed sharding ratios
(cost_models); the sharding-ratio LP (planner.ratios) then re-optimises the ratios for the
program found, and the two alternate (planner.planner).

State. `(k, F)`: nodes v_0 .. v_{k-1} are computed and F is the set of layout facts
`(tensor, layout)` held for *live* tensors, those with a consumer at index >= k (or the
loss). HAP keeps every fact ever derived, so no two paths meet and its search time grows
quadratically with depth; dropping dead tensors makes paths that reach the same frontier
merge into one state. F is a frozenset of small integer fact ids, so union, filtering and
hashing cost O(live facts) whatever the depth; a successor's facts are joined from the
parent's with checks on the added facts only (planner.facts).

Transitions. From `(k, F)`, for each rule of v_k: make each input available (free when in F;
else the first storage of a graph input, or the cheapest conversion, planner.transitions),
add the output fact, drop facts of tensors whose last consumer is v_k. Transition cost =
compute cost of v_k under the rule + storage, gradient-sync and conversion costs.

Goal. `k = N`; the loss is then P or R (R -> P is a free local instruction).

Heuristic. h(k, F) = C(k) + max(sum_t D(t, F_t), max_t E(t, F_t)) over live tensors t:
  C(k)      = sum_{j >= k} min_rule compute(v_j, rule)  (suffix sums in topological order)
  D(t, F_t) = max over t's remaining consumers c of min over c's rules r of the cheapest
              conversion of t from a layout in F_t to the layout r needs (0 if held)
  E(t, F_t) = max over t's remaining consumers c of min over c's rules r of
              [ conversion of t to r's layout + extra(c, r) + E(c, {r's output layout}) ]
              with extra(c, r) = compute(c, r) - min_r' compute(c, r'), computed once by a
              backward pass over the graph (planner.bounds)
Every remaining node is computed under some rule (>= C(k)). Whatever rules are chosen, the
consumer attaining the max in D must get t in its rule's layout (>= D); conversions of
different tensors are different instructions, so the D's add up. E follows one chain of
consumers from t: along it every node pays at least its extra compute above the minimum
counted in C, and every conversion on the chain is paid; chains of different tensors may
share nodes, so only the largest E counts. Every cost is >= 0, so h never overestimates
(admissible). It is not consistent, so a state whose cost improves is re-opened. HAP uses
h = 0 (uniform-cost search). D and E rank dead-end layouts last: a weight sharded so that a
later consumer must all-gather it, or produce a huge Partial output, is charged now.

Bounded width. Paths through independent branches (q, k and v projections) multiply the
states of one depth. At most `width` states are expanded per depth and *stratum*, in order
of f = g + h; a stratum is the set of facts a state holds about long-lived tensors (those
read again more than `HORIZON` nodes later, such as a tied embedding), so that a choice
whose price comes much later (store the embedding sharded now, all-gather it at the output
layer) cannot crowd out the alternatives; at most `width * MAX_STRATA` states are expanded
per depth in all. A tensor read by more than MAX_STRATUM_READS nodes (a causal mask or rotary
table that every layer reads) defines no stratum: its layout is priced at each layer's read,
which the heuristic sees, not only much later (as strata, the layouts of a Llama's mask
doubled the expansions without changing the plan). `SearchResult.exact` is False when a state was left unexpanded for this
reason. The number of expansions grows linearly with depth.

Lazy evaluation. Most generated states are never expanded, so a state enters the queue with
the cheap admissible key g + C(k) and gets its full h when it first reaches the front; it is
then re-queued with g + h. Expansion order is A*'s on the full heuristic.

Incumbent. The caller may pass the cost of a known program (the data-parallel program, a
point of the same space); states with f >= that cost are pruned (branch and bound, exact
since h is admissible), and when nothing cheaper is found the search says so.

Repeated blocks. Transitions depend only on the node and on the facts of its inputs. They
are memoised by a structural signature of the node (op, arguments, shapes, FLOPs, and per
input its kind, dim classes' units, liveness, batch dims and forced layout) and the input
facts with tensors replaced by their argument position, so the layers of a repeated block
share one set of transitions, renamed for the node when the program is read back
(planner.signature).

Runs of blocks. A model whose search order holds a run of at least periodic.MIN_RUN equal
blocks (planner.periodic: same structure and costs node for node, each reading the same
shared tensors) is searched in parts: the nodes before the run, each block of the run, and
the rest down to the goal. Each block is searched from the states reached at its start, at
the first block's position (states renamed, costs relative to the least), until its width is
exhausted; states one of which makes another pointless are dropped between blocks
(_Search._undominated). Where two blocks start from the same states at the same relative
costs, the second reuses the first's search, renamed: this is exact (the program and cost
are those of searching every block, up to cost ties under 1e-11 s; `REUSE` False checks it).
On a transformer the starts repeat after a few blocks, so a 32-block Llama costs the search
of about eight. What is not exact is the comparison with the whole search, which
interleaves depths in order of f and stops at the first goal: the two are different bounded
searches of the same space, and the block search's program is as cheap or cheaper in the
search's own cost on the models tests/test_block_search.py compares; the predicted step
can still differ where the search's cost and the prediction disagree (a gradient all-reduce
charged in full that the prediction overlaps).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import time
from dataclasses import dataclass

from hetsynth.instruction_set.layouts import P, R, Layout
from hetsynth.instruction_set.program import Instruction
from hetsynth.planner.bounds import ChainBound
from hetsynth.planner.facts import FactTable
from hetsynth.planner.periodic import Run, find_run, translate
from hetsynth.planner.problem import Problem
from hetsynth.planner.signature import Signatures, actual_facts, canonical_facts, canonical_move, instantiate
from hetsynth.planner.transitions import Fact, Move, moves

log = logging.getLogger(__name__)

INF = float("inf")

DEFAULT_WIDTH = 32
HORIZON = 40  # nodes; facts of tensors read again later than this define a state's stratum
MAX_STRATUM_READS = 3  # ... unless more nodes than this read the tensor (a per-layer input)
MAX_STRATA = 4  # at most width * MAX_STRATA expansions per depth in all
REUSE = True  # a block's search reused for another block with the same start (False: tests of exactness)


class SearchError(RuntimeError):
    """No program exists (cannot happen while every op keeps its all-R rule)."""


@dataclass(frozen=True)
class SearchResult:
    instructions: tuple[Instruction, ...]
    cost_s: float
    states_expanded: int
    seconds: float
    exact: bool


def compute_suffix(pb: Problem) -> list[float]:
    """C[k]: suffix sums of each node's cheapest compute cost; C[N] = 0."""
    mins = [min(pb.compute_s(node, ri) for ri in range(len(pb.rules[node.name]))) for node in pb.order]
    c = [0.0] * (len(mins) + 1)
    for k in range(len(mins) - 1, -1, -1):
        c[k] = c[k + 1] + mins[k]
    return c


class _Pending:
    """D(t, F_t) of the heuristic, memoised per (t, held layouts, depth)."""

    def __init__(self, pb: Problem) -> None:
        self.pb = pb
        self.consumers: dict[str, list[int]] = {}
        for k, node in enumerate(pb.order):
            for t in set(node.inputs):
                self.consumers.setdefault(t, []).append(k)
        self.memo: dict[tuple[str, frozenset[Layout], int], float] = {}
        self.wants: dict[tuple[str, int], int] = {}  # (t, j) -> id of t's layouts per rule of j
        self.wants_ids: dict[tuple[tuple[Layout, ...], ...], int] = {}
        self.shared: dict[tuple[int, frozenset[Layout], int], float] = {}

    def bound(self, tensor: str, held: frozenset[Layout], k: int) -> float:
        users = self.consumers.get(tensor, ())
        first = bisect.bisect_left(users, k)
        key = (tensor, held, -1 - first)
        if key not in self.memo:
            self.memo[key] = max((self._consumer(tensor, held, j) for j in users[first:]), default=0.0)
        return self.memo[key]

    def _consumer(self, tensor: str, held: frozenset[Layout], j: int) -> float:
        """The bound for consumer j, shared by tensors of the same structure that consumers
        want in the same layouts per rule (all it depends on)."""
        key = (tensor, held, j)
        if key not in self.memo:
            skey = (self.pb.structure_id(tensor), held, self._wants_id(tensor, j))
            if skey not in self.shared:
                self.shared[skey] = self._consumer_bound(tensor, held, j)
            self.memo[key] = self.shared[skey]
        return self.memo[key]

    def _wants_id(self, tensor: str, j: int) -> int:
        key = (tensor, j)
        if key not in self.wants:
            node = self.pb.order[j]
            wants = tuple(tuple(w for t, w in zip(node.inputs, rule.inputs) if t == tensor)
                          for rule in self.pb.rules[node.name])
            self.wants[key] = self.wants_ids.setdefault(wants, len(self.wants_ids))
        return self.wants[key]

    def _consumer_bound(self, tensor: str, held: frozenset[Layout], j: int) -> float:
        node = self.pb.order[j]
        best = float("inf")
        for rule in self.pb.rules[node.name]:
            need = 0.0
            for t, want in zip(node.inputs, rule.inputs):
                if t == tensor and want not in held:
                    paths = [self.pb.conversion(t, h, want) for h in held]
                    costs = [sum(s.cost_s for s in p) for p in paths if p is not None]
                    need = max(need, min(costs, default=float("inf")))
            best = min(best, need)
        return best if best != float("inf") else 0.0


class _Progress:
    """A log line (INFO) about once a second for searches longer than a second."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled, total
        self.start = self.last = time.perf_counter()

    def tick(self, expanded: int, k: int, f: float) -> None:
        now = time.perf_counter()
        if self.enabled and now - self.start > 1.0 and now - self.last > 1.0:
            self.last = now
            log.info("synthesis: %s states expanded, node %d/%d, best bound %.3f ms",
                     f"{expanded:,}", k, self.total, f * 1e3)


class _Search:
    def __init__(self, pb: Problem, width: int, progress: bool, incumbent: float) -> None:
        self.pb, self.width, self.incumbent = pb, width, incumbent
        self.n = len(pb.order)
        self.C = compute_suffix(pb)
        self.F = FactTable(pb)
        self.pending = _Pending(pb)
        self.chains = ChainBound(pb)
        self.memo: dict[tuple[int, frozenset[int]], list[tuple[Move, frozenset[int]]]] = {}
        self.signatures = Signatures(pb, self.F.dead_after)
        self.shared: dict[tuple, list[Move]] = {}
        self.added_ids: dict[tuple[int, frozenset[Fact]], tuple[frozenset[int], tuple]] = {}
        self.report = _Progress(progress, self.n)
        self.depth_cap = width * MAX_STRATA
        self.long_lived = self._long_lived()
        self.h_memo: dict[tuple[int, frozenset[int]], float] = {}
        self.t_memo: dict[tuple[str, frozenset[Layout], int], tuple[float, float]] = {}
        self.exact = True
        self.expanded = 0
        self.shift = 0  # nodes between the block searched at the template and the one it is for

    def h(self, k: int, mask: frozenset[int]) -> float:
        conversions, chains = 0.0, 0.0
        for t, layouts in self._held(mask).items():
            d, e = self.tensor_bound(t, layouts, k)
            conversions += d
            chains = max(chains, e)
        return self.C[k] + max(conversions, chains)

    def tensor_bound(self, tensor: str, held: frozenset[Layout], k: int) -> tuple[float, float]:
        """(D, E) of one live tensor; both depend on k only through its first consumer >= k."""
        key = (tensor, held, bisect.bisect_left(self.pending.consumers.get(tensor, ()), k))
        bound = self.t_memo.get(key)
        if bound is None:
            bound = self.t_memo[key] = (self.pending.bound(tensor, held, k), self.chains.bound(tensor, held, k))
        return bound

    def f_bound(self, k: int, mask: frozenset[int], g: float) -> float:
        key = (k, mask)
        h = self.h_memo.get(key)
        if h is None:
            h = self.h_memo[key] = self.h(k, mask)
        return g + h

    def successors(self, k: int, mask: frozenset[int]) -> list[tuple[Move, tuple[frozenset[int], tuple]]]:
        """Canonical moves at node k (renamed for it only on the way back, synthesize), the
        ids of the facts each adds about tensors still live after k, and their checks
        (FactTable.checks)."""
        key = (k, self.F.inputs(mask, k))
        if key not in self.memo:
            self.memo[key] = [(m, self._added_ids(k, m.added)) for m in self._moves(k, self.F.decode(key[1]))]
        return self.memo[key]

    def _added_ids(self, k: int, added: frozenset[Fact]) -> tuple[frozenset[int], tuple]:
        key = (k, added)
        ids = self.added_ids.get(key)
        if ids is None:
            live = self.F.live_added(self.F.encode(actual_facts(added, self.signatures.names(k))), k)
            ids = self.added_ids[key] = (live, self.F.checks(live))
        return ids

    def _moves(self, k: int, facts: frozenset[Fact]) -> list[Move]:
        """moves() through the structural memo shared by repeated layers, canonical."""
        names = self.signatures.names(k)
        key = (self.signatures.of(k), canonical_facts(facts, names))
        if key not in self.shared:
            dead = frozenset(self.F.dead_after[k])
            self.shared[key] = [canonical_move(m, names) for m in moves(self.pb, k, facts, dead)]
        return self.shared[key]

    def _long_lived(self) -> list[frozenset[str]]:
        """Per depth k: tensors live at k whose next read is more than HORIZON nodes away,
        read by at most MAX_STRATUM_READS nodes."""
        reads: dict[str, list[int]] = {}
        for j, node in enumerate(self.pb.order):
            for t in dict.fromkeys(node.inputs):
                reads.setdefault(t, []).append(j)
        out: list[set[str]] = [set() for _ in range(self.n + 1)]
        for t, js in reads.items():
            if len(js) <= MAX_STRATUM_READS:
                for a, b in zip(js, js[1:]):  # between reads a < b the next read is b
                    for k in range(a + 1, b - HORIZON):
                        out[k].add(t)
        return [frozenset(ts) for ts in out]

    def stratum(self, k: int, mask: frozenset[int]) -> frozenset[int]:
        return self.F.restrict(mask, self.long_lived[k]) if self.long_lived[k] else frozenset()

    def run(self) -> tuple[float, list[tuple[int, Move]], State] | None:
        """(cost, path, goal state) of the program found, the path as (node index, canonical
        move) in order; None when nothing beats the incumbent. A long run of repeated blocks is
        searched block by block (_by_blocks), anything else whole."""
        run = find_run(self.pb, self.signatures)
        if run is None:
            found = self._search({(0, frozenset()): 0.0}, self.n, prune=True)
            found = None if found is None else (found.costs[found.goal], _walk(found.parent, found.goal)[1], found.goal)
        else:
            found = self._by_blocks(run)
        if found is not None or self.incumbent < float("inf"):
            return found
        raise SearchError("no distributed program found: some op has no applicable rule")

    def _search(self, sources: dict[State, float], hi: int, *, prune: bool) -> "_Reached | None":
        """A* from `sources` (state -> cost so far) over the nodes below `hi`. With hi = N it
        ends at the first goal state popped (`goal`; None when there is none); otherwise it
        runs until no state below hi is left to expand and returns every state reached at
        depth hi, none expanded there. `prune`: cut states whose f reaches the incumbent
        (only where h is that of the state's own position)."""
        g = dict(sources)
        parent: dict[State, tuple | None] = {s: None for s in sources}
        counter = itertools.count()
        heap = [(cost + self.C[s[0]], next(counter), s, cost, False) for s, cost in _ordered(sources, self.F)]
        heapq.heapify(heap)
        expanded_at: dict[tuple[int, frozenset[int]], int] = {}
        depth_total: dict[int, int] = {}
        reached: dict[State, float] = {}
        while heap:
            f, _, state, cost, exact_f = heapq.heappop(heap)
            if cost > g[state]:
                continue  # stale entry: the state was re-reached more cheaply
            k, mask = state
            stratum = (k, self.stratum(k, mask))
            if expanded_at.get(stratum, 0) >= self.width or depth_total.get(k, 0) >= self.depth_cap:
                self.exact = False  # keys only grow: states expanded at this depth were cheaper
                continue
            if not exact_f:  # pushed with the lower bound C(k): evaluate h now, re-queue
                heapq.heappush(heap, (self.f_bound(k, mask, cost), next(counter), state, cost, True))
                continue
            if k == self.n:
                return _Reached(g, parent, state)
            if prune and f >= self.incumbent:
                continue  # branch and bound: cannot beat the known program
            expanded_at[stratum] = expanded_at.get(stratum, 0) + 1
            depth_total[k] = depth_total.get(k, 0) + 1
            self.expanded += 1
            self.report.tick(self.expanded, k + self.shift, f)
            live, below, join, known = self.F.live(mask, k), self.C[k + 1], self.F.join, g.get
            for move, (bits, checks) in self.successors(k, mask):
                nxt = (k + 1, join(live, bits, checks))
                new = cost + move.cost
                if new < known(nxt, INF) - 1e-15:
                    g[nxt], parent[nxt] = new, (state, move)
                    if k + 1 == hi < self.n:
                        reached[nxt] = new
                    else:
                        heapq.heappush(heap, (new + below, next(counter), nxt, new, False))
        return _Reached(reached, parent) if hi < self.n else None

    def _by_blocks(self, run: Run) -> tuple[float, list[tuple[int, Move]], State] | None:
        """The search in three parts: the nodes before the run of repeated blocks (pruned by
        the incumbent), each block of the run, and the nodes after it down to the goal.

        Block q is searched at the template's position (block 0 of the run): its start
        states renamed by tau_q (planner.periodic), with their costs less the least of
        them, so that the search sees the same states, costs and heuristic whichever block
        it is for; the states reached at the template's end are renamed back to block q's
        end and the least cost added back. Two blocks whose start states and relative
        costs are equal (costs to 1e-11 s) thus run the same search, and the second reuses
        the first's result: a run of P blocks costs the search of the few blocks before
        its frontier repeats, and gives exactly what searching each block would (up to
        cost ties under 1e-11 s). Inside the run states are not pruned by the incumbent (h
        at the template's position is no bound for a later block's); the width bound is
        per depth as everywhere. Unlike the whole search, which interleaves depths in order
        of f and stops at the first goal, each block is searched until its width is
        exhausted: a different bounded search, checked against the whole one on several
        models (tests/test_block_search.py), not a rearrangement of it."""
        start: State = (0, frozenset())
        first = (self._search({start: 0.0}, run.first, prune=True) if run.first else
                 _Reached({start: 0.0}, {start: None}))  # the run begins at the first node
        segments: list[tuple[_Reached, int]] = [(first, -1)]
        frontier = self._undominated(first.costs)
        memo: dict[tuple, _Reached] = {}
        searched = 0
        for q in range(run.blocks):
            if not frontier:
                return None
            base = min(frontier.values())
            moved = self._moved(frontier, run.first, run.to_template(q), run.inside, base)
            if moved is None:  # a state this block's renaming cannot carry: searched in place
                block = self._search(frontier, run.start(q) + run.length, prune=False)
                segments.append((block, -1))
                frontier = self._undominated(block.costs)
                searched += 1
                continue
            key = tuple(sorted((_key(self.F, s[1]), round(c, 11)) for s, c in moved.items()))
            if key not in memo or not REUSE:
                self.shift = run.start(q) - run.first
                memo[key] = self._search(moved, run.first + run.length, prune=False)
                self.shift, searched = 0, searched + 1
            block = memo[key]
            out = self._moved(block.costs, run.start(q) + run.length, run.from_template(q), run.inside, -base)
            assert out is not None, "tau covers every tensor a block outputs"
            segments.append((block, q))
            frontier = self._undominated(out)
        if self.report.enabled:
            log.info("synthesis: %d repeated blocks of %d ops from node %d: %d searched, the others' searches reused",
                     run.blocks, run.length, run.first, searched)
        last = self._search(self._undominated(frontier), self.n, prune=True)
        if last is None:
            return None
        return last.costs[last.goal], self._stitch(run, segments, last), last.goal

    def _undominated(self, states: dict[State, float]) -> dict[State, float]:
        """`states` (all at one depth) without those another makes pointless: s is dropped when
        some s* costs g(s*) + conv(s* -> s) <= g(s), conv the cheapest conversions (the
        chain bound's, planner.bounds) of what s* holds into each layout s holds that s* does
        not. Any program from s is then one from s* with those conversions added where s's
        layouts are first read, and costs no more. Without this a state whose cost grows
        against the best by a fixed amount per block would keep every block's start
        different, and no block's search could be reused. Each state is tested against the
        `width` cheapest."""
        order = sorted(states.items(), key=lambda item: item[1])
        held = [self._held(s[1]) for s, _ in order]
        kept: list[int] = []
        for i, (state, cost) in enumerate(order):
            if not any(order[j][1] + self._conversions(held[j], held[i]) <= cost for j in kept[:self.width]):
                kept.append(i)
        return {order[i][0]: order[i][1] for i in kept}

    def _held(self, mask: frozenset[int]) -> dict[str, frozenset[Layout]]:
        """The layouts held of each tensor, tensors in the order of the mask's fact ids (a
        fixed order: the heuristic's sum of conversions adds up in it)."""
        held: dict[str, list[Layout]] = {}
        facts, tensor = self.F.facts, self.F.tensor
        for i in mask:
            held.setdefault(tensor[i], []).append(facts[i][1])
        return {t: frozenset(layouts) for t, layouts in held.items()}

    def _conversions(self, have: dict[str, frozenset[Layout]], want: dict[str, frozenset[Layout]]) -> float:
        total = 0.0
        for t, layouts in want.items():
            source = have.get(t)
            for layout in layouts:
                if source is None:
                    return INF
                if layout not in source:
                    total += self.chains.conversion(t, source, layout)
        return total

    def _moved(self, states: dict[State, float], k: int, maps: tuple[dict[str, str], dict[str, str]] | None,
               inside: range, base: float) -> dict[State, float] | None:
        """`states` renamed by maps = (mapping, its inverse) (None: unchanged) to depth k, costs
        less `base`; None when some state cannot be renamed (periodic.translate)."""
        out: dict[State, float] = {}
        for (_, mask), cost in states.items():
            if maps is not None:
                facts = translate(self.F.decode(mask), *maps, inside, self.pb.index)
                if facts is None:
                    return None
                mask = self.F.encode(frozenset(facts))
            out[(k, mask)] = cost - base
        return out

    def _stitch(self, run: Run, segments: list[tuple["_Reached", int]], last: "_Reached") -> list[tuple[int, Move]]:
        """The path from the start to the goal, walking back through the segments: a block
        searched at the template's position gives its moves `start(q) - first` nodes later
        and its states renamed between block q and the template (tau_q and its inverse)."""
        source, path = _walk(last.parent, last.goal)
        for block, q in reversed(segments):
            if q < 0:  # searched in place
                source, moves = _walk(block.parent, source)
            else:
                (state,) = self._moved({source: 0.0}, run.first + run.length, run.to_template(q), run.inside, 0.0)
                template, moves = _walk(block.parent, state)
                shift = run.start(q) - run.first
                moves = [(j + shift, m) for j, m in moves]
                (source,) = self._moved({template: 0.0}, run.start(q), run.from_template(q), run.inside, 0.0)
            path[:0] = moves
        assert source == (0, frozenset()), source
        return path


State = tuple[int, frozenset[int]]


@dataclass
class _Reached:
    """What a search from some sources reached: cost per state, and each state's parent
    (state, move) back to a source (None); `goal` the goal state popped, if that was it."""

    costs: dict[State, float]
    parent: dict[State, tuple | None]
    goal: State | None = None


def _walk(parent: dict[State, tuple | None], state: State) -> tuple[State, list[tuple[int, Move]]]:
    """The source `state` descends from and the (node index, move) pairs from it, in order."""
    path: list[tuple[int, Move]] = []
    while parent[state] is not None:
        prev, move = parent[state]
        path.append((prev[0], move))
        state = prev
    path.reverse()
    return state, path


def _key(table: FactTable, mask: frozenset[int]) -> tuple[str, ...]:
    return tuple(sorted(f"{t}={layout}" for t, layout in table.decode(mask)))


def _ordered(sources: dict[State, float], table: FactTable) -> list[tuple[State, float]]:
    """Sources in a fixed order (cost, then facts by name): the heap breaks ties by it."""
    if len(sources) == 1:
        return list(sources.items())
    return sorted(sources.items(), key=lambda item: (item[1], _key(table, item[0][1])))


def synthesize(pb: Problem, *, width: int = DEFAULT_WIDTH, progress: bool = True,
               incumbent: float = float("inf")) -> SearchResult | None:
    """A* over (k, live facts), at most `width` expansions per depth and stratum. With an
    incumbent cost, returns None when no program cheaper than it exists in the bounded search."""
    start_time = time.perf_counter()
    search = _Search(pb, width, progress, incumbent)
    found = search.run()
    if found is None:
        return None
    cost, path, goal = found
    program: list[Instruction] = []
    for k, move in path:
        move = instantiate(move, search.signatures.names(k))
        program += [e.instruction() for e in move.resolved()]
    loss_layouts = {layout for t, layout in search.F.decode(goal[1]) if t == pb.graph.loss}
    if P not in loss_layouts:
        assert R in loss_layouts, loss_layouts
        program.append(Instruction(kind="partial", tensor=pb.graph.loss, src=R, layout=P, variant="local"))
    return SearchResult(tuple(program), cost, search.expanded, time.perf_counter() - start_time, search.exact)
