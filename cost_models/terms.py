"""Cost terms that compose: one instruction's time as forms run one after the other (Series)
or at the same time (Overlap).

A `Form` is one bulk-synchronous piece of work on a set of devices D (entries of the cost
vectors; all of them by default), affine in each device's share (cost_models.linear_cost):

    seconds(Form)    = max_{i in D} (a_i + b_i s_i)
    seconds(Series)  = sum_p seconds(p)                (parts in order)
    seconds(Overlap) = max_p seconds(p)                (the longest part counts)

Every form has a category (compute, communication or local, instruction_set.kinds), so a step
can be split into the time each device computes (`busy`: every compute form, overlapped or
not) and the communication left exposed (`exposed`: for an Overlap, what it adds over its
parts without communication). How a form's shares follow the ratios r in the sharding-ratio LP
is its `ShareKind`: FLAT s_i = r_i; NODE s_i = sum of r over device i's node; FIXED (shares
inside one node only) held at their current values; NONE not split. The LP (planner.ratios)
turns every max into an epigraph variable with one constraint per form and device, which is
exact: max and sum of affine functions are convex, and the objective presses each variable
onto its tightest constraint.

Today's instructions are single forms (`Term.leaf`); an Overlap is what overlapped gradient
synchronisation, fused collective-matmuls and concurrent pipeline stages are written in.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Iterator, Union

from hetsynth.cost_models.linear_cost import LinearCost
from hetsynth.cost_models.memory import MemoryTerm
from hetsynth.instruction_set.kinds import Category


class ShareKind(StrEnum):
    FLAT = "flat"
    NODE = "node"
    FIXED = "fixed"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class Shares:
    """Each entry's share where a form is evaluated, and how the shares follow the ratios."""

    values: tuple[float, ...]
    kind: ShareKind


@dataclass(frozen=True, slots=True)
class Form:
    """max over `devices` (None: all entries) of a_i + b_i s_i."""

    cost: LinearCost
    shares: Shares
    category: Category
    devices: tuple[int, ...] | None = None

    def entries(self) -> range | tuple[int, ...]:
        return range(len(self.cost.a)) if self.devices is None else self.devices

    @property
    def is_constant(self) -> bool:
        """Seconds that do not depend on the ratios (in the LP: a number)."""
        return self.shares.kind in (ShareKind.NONE, ShareKind.FIXED) or self.cost.is_constant


@dataclass(frozen=True, slots=True)
class Series:
    """One after the other: the parts add up."""

    parts: tuple["Cost", ...]


@dataclass(frozen=True, slots=True)
class Overlap:
    """At the same time: the longest part counts."""

    parts: tuple["Cost", ...]


Cost = Union[Form, Series, Overlap]


@dataclass(frozen=True, slots=True)
class Term:
    """One instruction's contribution: its time, and its memory evaluated at `memory_at`."""

    time: Cost
    memory: MemoryTerm | None = None
    memory_at: Shares | None = None

    @staticmethod
    def leaf(cost: LinearCost, shares: Shares, category: Category, memory: MemoryTerm | None = None) -> "Term":
        return Term(Form(cost, shares, category), memory, shares if memory is not None else None)


def seconds(c: Cost, _memo: dict[int, float] | None = None) -> float:
    """The time of a cost (module docstring). A part shared by several branches (the same
    object) is evaluated once per call."""
    if isinstance(c, Form):
        if c.devices is None:
            return c.cost.at(c.shares.values)
        a, b, s = c.cost.a, c.cost.b, c.shares.values
        return max(a[i] + b[i] * s[i] for i in c.devices)
    memo = {} if _memo is None else _memo
    found = memo.get(id(c))
    if found is None:
        # sum() and max() written out (the same additions in the same order, the same first
        # maximum): this is the planner's innermost loop, and a generator per node cost a third
        series, get = isinstance(c, Series), memo.get
        total: float | None = 0.0 if series else None
        for p in c.parts:
            value = get(id(p))
            if value is None:  # a form too is kept: the bucket syncs recur in many branches
                value = memo[id(p)] = seconds(p, memo)
            if series:
                total += value  # type: ignore[operator]
            elif total is None or value > total:
                total = value
        if total is None:
            raise ValueError("an Overlap of no parts has no time")
        found = memo[id(c)] = total
    return found


def forms(c: Cost) -> Iterator[Form]:
    """Every form of a cost, depth first."""
    if isinstance(c, Form):
        yield c
    else:
        for p in c.parts:
            yield from forms(p)


def busy(c: Cost, category: Category, n: int) -> list[float]:
    """Per entry: the seconds of its forms of `category`, overlapped or not, each piece of work
    once. The branches of an Overlap may be paths through one schedule that share steps (the
    same object: planner.step_cost's backward segments appear in every branch that waits for
    them), so a step counts as often as the branch that holds it most often, not once per branch."""
    out = [0.0] * n
    for part, count in _work(c).values():
        if isinstance(part, Form):
            if part.category is category:
                a, b, s = part.cost.a, part.cost.b, part.shares.values
                for i in part.entries():
                    out[i] += count * (a[i] + b[i] * s[i])
        else:
            for i, v in enumerate(busy(part, category, n)):
                out[i] += count * v
    return out


def _work(c: Cost) -> dict[int, tuple[Cost, int]]:
    """The steps of `c` (by identity) with how many times each is done: a Form is one step, a
    Series its parts' steps added, an Overlap, per step, the most any branch does it."""
    if isinstance(c, Form):
        return {id(c): (c, 1)}
    if isinstance(c, Series):
        out: dict[int, tuple[Cost, int]] = {}
        for p in c.parts:
            key, count = id(p), out.get(id(p), (p, 0))[1]
            out[key] = (p, count + 1)
        return out
    merged: dict[int, tuple[Cost, int]] = {}
    for branch in c.parts:
        for key, (part, count) in _work(branch).items():
            merged[key] = (part, max(count, merged.get(key, (part, 0))[1]))
    return merged


def without(c: Cost, category: Category, _memo: dict[int, Cost | None] | None = None) -> Cost | None:
    """The cost with the forms of `category` left out (None when nothing is left). A part
    shared by several branches (the same object) stays one shared object in the result, so
    that `seconds` evaluates it once."""
    if isinstance(c, Form):
        return None if c.category is category else c
    memo = {} if _memo is None else _memo
    if id(c) not in memo:
        parts = tuple(p for p in (without(q, category, memo) for q in c.parts) if p is not None)
        memo[id(c)] = type(c)(parts) if parts else None
    return memo[id(c)]


def exposed(c: Cost, category: Category) -> float:
    """Seconds that the forms of `category` add to `c`: all of a form of that category, the
    sum over a Series' parts, and for an Overlap its time minus its time without them."""
    if isinstance(c, Form):
        return seconds(c) if c.category is category else 0.0
    if isinstance(c, Series):
        return sum(exposed(p, category) for p in c.parts)
    rest = without(c, category)
    return seconds(c) - (seconds(rest) if rest is not None else 0.0)
