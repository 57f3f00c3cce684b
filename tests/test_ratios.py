"""The sharding-ratio LP: one test per constraint family, and the infeasible case."""

from __future__ import annotations

import pytest

from hetsynth.cost_models.linear_cost import LinearCost
from hetsynth.cost_models.memory import GIB, MemoryTerm
from hetsynth.cost_models.terms import Shares, ShareKind, Term
from hetsynth.instruction_set.kinds import Category
from hetsynth.planner.ratios import MemoryInfeasible, least_memory_overflow, solve_ratios

COMPUTE, COMM = Category.COMPUTE, Category.COMMUNICATION


def flat(values: tuple[float, ...]) -> Shares:
    return Shares(values, ShareKind.FLAT)


def compute(work: tuple[float, ...]) -> Term:
    """A compute term split over all devices (shares = ratios)."""
    return Term.leaf(LinearCost((0.0,) * len(work), work), flat((1.0 / len(work),) * len(work)), COMPUTE)


def test_simplex_ratios_sum_to_one() -> None:
    sol = solve_ratios([compute((1.0, 1.0, 1.0))], [16, 16, 16])
    assert sum(sol.ratios) == pytest.approx(1.0)
    assert sol.ratios == pytest.approx((1 / 3,) * 3, abs=1e-6)


def test_compute_epigraph_follows_throughput() -> None:
    # device 0 is twice as fast: seconds per unit share 1.0 vs 2.0 -> ratios 2/3, 1/3
    sol = solve_ratios([compute((1.0, 2.0))] * 5, [16, 16])
    assert sol.ratios == pytest.approx((2 / 3, 1 / 3), abs=1e-6)
    assert sol.objective_s == pytest.approx(5 * 2 / 3, rel=1e-6)


def test_communication_epigraph_prefers_even_for_padded_collectives() -> None:
    # a padded all-gather costs (n-1) * max share * D / beta: minimised by even shares
    padded = Term.leaf(LinearCost((0.1, 0.1), (3.0, 3.0)), flat((0.5, 0.5)), COMM)
    sol = solve_ratios([padded, compute((1.0, 1.05))], [16, 16])
    assert sol.ratios[0] == pytest.approx(0.5, abs=0.02)


def test_memory_constraint_caps_a_device() -> None:
    # device 0 is faster but holds at most 1 GiB of a 4 GiB activation: ratio <= 0.25
    mem = Term.leaf(LinearCost((0.0, 0.0), (0.0, 0.0)), flat((0.5, 0.5)), COMPUTE,
                    MemoryTerm((0.0, 0.0), (4 * GIB, 4 * GIB)))
    sol = solve_ratios([compute((1.0, 3.0)), mem], [1.0, 16.0])
    assert sol.ratios[0] == pytest.approx(0.25, abs=1e-6)


def test_infeasible_memory_raises_and_reports_overflow() -> None:
    mem = Term.leaf(LinearCost((0.0, 0.0), (0.0, 0.0)), Shares((1.0, 1.0), ShareKind.NONE), COMPUTE,
                    MemoryTerm((3 * GIB, 3 * GIB), (0.0, 0.0)))
    with pytest.raises(MemoryInfeasible):
        solve_ratios([compute((1.0, 1.0)), mem], [2.0, 2.0])
    _, over = least_memory_overflow([mem], [2.0, 2.0])
    assert over == pytest.approx([1.0, 1.0])


def test_node_shares_sum_the_nodes_ratios() -> None:
    # work split across nodes only: node {0,1} does 1 s per unit share, node {2,3} 3 s.
    # Node shares are sums of the node's ratios: the LP balances the nodes 3:1.
    node = Term.leaf(LinearCost((0.0,) * 4, (1.0, 1.0, 3.0, 3.0)), Shares((0.5,) * 4, ShareKind.NODE), COMPUTE)
    sol = solve_ratios([node], [16] * 4, nodes=[0, 0, 1, 1])
    assert sol.ratios[0] + sol.ratios[1] == pytest.approx(0.75, abs=1e-6)


def test_the_solver_prints_no_banner() -> None:
    """highspy's banner, written at a process's first Highs(), does not reach the plan's output."""
    import subprocess
    import sys

    code = ("from hetsynth.planner.ratios import _solver\nprint('before')\n_solver()\n"
            "import highspy\nhighspy.Highs()\nprint('after')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["before", "after"], out.stdout
