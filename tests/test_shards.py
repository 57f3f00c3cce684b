"""Shard lengths: largest-remainder rounding and dim classes derived once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetsynth.instruction_set.shards import DimClasses, largest_remainder


@given(st.lists(st.floats(0, 10), min_size=1, max_size=9).filter(lambda r: sum(r) > 0),
       st.integers(0, 500))
@settings(max_examples=200, deadline=None)
def test_largest_remainder_sums_and_is_close(ratios: list[float], total: int) -> None:
    out = largest_remainder(ratios, total)
    assert sum(out) == total and all(x >= 0 for x in out)
    w = sum(ratios)
    assert all(abs(x - r / w * total) < 1 + 1e-9 for x, r in zip(out, ratios))


def test_zero_ratio_gives_zero_length() -> None:
    assert largest_remainder([0.6, 0.0, 0.4], 5) == [3, 0, 2]


def test_bad_ratios() -> None:
    with pytest.raises(ValueError, match="ratios must be"):
        largest_remainder([0, 0], 3)


def test_view_merge_scales_lengths() -> None:
    # x [5, 16] S0 --view--> y [80] S0: lengths of y are lengths of x times 16
    classes = DimClasses({("x", 0): 5, ("x", 1): 16, ("y", 0): 80}, [(("x", 0), ("y", 0))])
    lx = classes.lengths("x", 0, [0.55, 0.45])
    assert lx == [3, 2] and classes.lengths("y", 0, [0.55, 0.45]) == [48, 32]


def test_head_split_uses_head_units() -> None:
    # hidden 12 viewed as 3 heads of 4: hidden lengths are multiples of 4
    classes = DimClasses({("h", 0): 12, ("heads", 0): 3}, [(("h", 0), ("heads", 0))])
    assert classes.lengths("h", 0, [0.5, 0.5]) in ([8, 4], [4, 8])
    assert all(n % 4 == 0 for n in classes.lengths("h", 0, [0.7, 0.2, 0.1]))


def test_incommensurate_sizes_get_a_common_unit() -> None:
    # a class holding sizes 6 and 4 (linked views): root 4, member 6 needs root multiples of 2
    classes = DimClasses({("a", 0): 6, ("b", 0): 4}, [(("a", 0), ("b", 0))])
    lb = classes.lengths("b", 0, [0.5, 0.5])
    assert all(n % 2 == 0 for n in lb) and sum(classes.lengths("a", 0, [0.5, 0.5])) == 6


def test_empty_dims_have_empty_shards() -> None:
    """A dim of size 0 (an empty slice, such as a rotary pass-through of width 0)."""
    from hetsynth.instruction_set.shards import DimClasses

    classes = DimClasses({("t", 0): 4, ("t", 1): 0}, [])
    assert classes.lengths("t", 1, [0.5, 0.5]) == [0, 0]
    assert classes.lengths("t", 0, [0.5, 0.5]) == [2, 2]
