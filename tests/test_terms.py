"""Cost terms that compose (cost_models.terms): seconds, busy and exposed time of Series and
Overlaps, and the ratio LP's lowering of an Overlap to one epigraph against hand-solved cases."""

from __future__ import annotations

import random

import pytest

from hetsynth.cost_models.linear_cost import LinearCost
from hetsynth.cost_models.terms import Form, Overlap, Series, Shares, ShareKind, Term, busy, exposed, seconds
from hetsynth.instruction_set.kinds import Category
from hetsynth.planner.ratios import solve_ratios

COMPUTE, COMM = Category.COMPUTE, Category.COMMUNICATION


def form(a: tuple[float, ...], b: tuple[float, ...], category: Category, shares: tuple[float, ...] | None = None,
         devices: tuple[int, ...] | None = None) -> Form:
    shares = shares if shares is not None else (1.0 / len(a),) * len(a)
    return Form(LinearCost(a, b), Shares(shares, ShareKind.FLAT), category, devices)


def test_seconds_busy_and_exposed_of_a_small_tree() -> None:
    """Compute 1.0/0.5 s beside 0.7 s of communication hides it; beside 0.4 s of compute,
    0.3 s of it is exposed. Busy compute counts every compute form, overlapped or not."""
    hidden = Overlap((form((1.0, 0.5), (0.0, 0.0), COMPUTE), form((0.7, 0.7), (0.0, 0.0), COMM)))
    shown = Overlap((form((0.4, 0.4), (0.0, 0.0), COMPUTE), form((0.7, 0.7), (0.0, 0.0), COMM)))
    step = Series((hidden, shown))
    assert seconds(hidden) == 1.0 and exposed(hidden, COMM) == 0.0
    assert exposed(shown, COMM) == pytest.approx(0.3)
    assert seconds(step) == pytest.approx(1.7)
    assert exposed(step, COMM) == pytest.approx(0.3)
    assert exposed(step, COMPUTE) == pytest.approx(0.3)  # 1.0 beside 0.7 adds 0.3; 0.4 beside 0.7 nothing
    assert busy(step, COMPUTE, 2) == pytest.approx([1.4, 0.9])
    assert busy(step, COMM, 2) == pytest.approx([1.4, 1.4])


def test_busy_counts_a_step_shared_by_overlap_branches_once() -> None:
    """The backward overlap's branches share segments (the same objects): the backward's compute
    is done once, however many buckets wait for it; a form twice in one branch is done twice."""
    seg1 = Series((form((1.0, 2.0), (0.0, 0.0), COMPUTE),))
    seg2 = Series((form((0.5, 0.5), (0.0, 0.0), COMPUTE),))
    sync = form((0.3, 0.3), (0.0, 0.0), COMM)
    twice = form((0.25, 0.25), (0.0, 0.0), COMPUTE)
    overlap = Overlap((Series((seg1, seg2, twice, twice)), Series((seg1, sync)), Series((seg1, seg2, sync))))
    assert busy(overlap, COMPUTE, 2) == pytest.approx([2.0, 3.0])
    assert busy(overlap, COMM, 2) == pytest.approx([0.3, 0.3])


def test_a_form_on_some_devices_counts_only_there() -> None:
    f = form((5.0, 1.0, 2.0), (0.0, 0.0, 0.0), COMPUTE, devices=(1, 2))
    assert seconds(f) == 2.0
    assert busy(f, COMPUTE, 3) == [0.0, 1.0, 2.0]


def test_a_series_of_leaves_is_todays_sum_bit_for_bit() -> None:
    rng = random.Random(0)
    forms = [form(tuple(rng.random() for _ in range(4)), tuple(rng.random() for _ in range(4)), COMPUTE,
                  tuple(rng.random() for _ in range(4))) for _ in range(50)]
    assert seconds(Series(tuple(forms))) == sum(f.cost.at(f.shares.values) for f in forms)


def test_lp_of_an_overlap_is_the_max_of_its_forms() -> None:
    """Compute r0 and 2 r1 seconds, overlapped with communication of 1.5 r0 on device 0:
    max(r0, 2 r1, 1.5 r0) is least where 1.5 r0 = 2 (1 - r0): r = (4/7, 3/7), 6/7 s. Run one
    after the other instead, the same forms cost max(r0, 2 r1) + 1.5 r0: least at r0 = 2/3."""
    compute = form((0.0, 0.0), (1.0, 2.0), COMPUTE)
    comm = form((0.0, 0.0), (1.5, 0.0), COMM)
    overlapped = solve_ratios([Term(Overlap((compute, comm)))], [16, 16])
    assert overlapped.ratios == pytest.approx((4 / 7, 3 / 7), abs=1e-6)
    assert overlapped.objective_s == pytest.approx(6 / 7, rel=1e-6)
    serial = solve_ratios([Term(Series((compute, comm)))], [16, 16])
    assert serial.ratios == pytest.approx((2 / 3, 1 / 3), abs=1e-6)
    assert serial.objective_s == pytest.approx(2 / 3 + 1.0, rel=1e-6)


def test_lp_of_nested_series_in_an_overlap_and_repeated_overlaps() -> None:
    """Overlap(Series(compute, compute), 1.2 s constant communication), twice: each is
    max(2 max(r0, 2 r1), 1.2), least at r0 = 2/3 (4/3 s); two of them 8/3 s."""
    compute = form((0.0, 0.0), (1.0, 2.0), COMPUTE)
    o = Overlap((Series((compute, compute)), form((1.2, 1.2), (0.0, 0.0), COMM)))
    sol = solve_ratios([Term(o), Term(o)], [16, 16])
    assert sol.ratios == pytest.approx((2 / 3, 1 / 3), abs=1e-6)
    assert sol.objective_s == pytest.approx(8 / 3, rel=1e-6)
    assert sol.objective_s == pytest.approx(2 * seconds(Overlap((Series((
        form((0.0, 0.0), (1.0, 2.0), COMPUTE, sol.ratios),) * 2), form((1.2, 1.2), (0.0, 0.0), COMM)))), rel=1e-6)
