"""The survival curves' maths on its own: log-normal priors, the binned curve's survival and
areas (exact against a fine numerical integral, inside a bin, across bins, and outside the
bins on either side), the blend of two curves, and the bins' edges."""

from __future__ import annotations

import math
from array import array
from itertools import pairwise

import pytest

from appliance.policy.wait_curves import (
    EDGES,
    MAX_GAP_S,
    MIN_GAP_S,
    N_BINS,
    BlendedCurve,
    LogNormal,
    WaitCurve,
    bin_of,
    hazards,
    life_table,
    prior_hazards,
)

PRIOR = LogNormal(30.0, 1.5)


def curve() -> WaitCurve:
    """A curve that falls in every bin and ends above 0: S at the edges of a log-normal,
    floored at 0.05, so that its last two points differ."""
    at = [1.0, *(max(PRIOR.survival(e), 0.05 + 1e-3 * i) for i, e in enumerate(EDGES[1:]))]
    return WaitCurve(array("d", at))


def numeric_area(c: WaitCurve, a_s: float, b_s: float, steps: int = 20_000) -> float:
    """The integral of `c.survival` by trapezoids on a log grid (and linear below MIN)."""
    total = 0.0
    if a_s < MIN_GAP_S:
        total += min(b_s, MIN_GAP_S) - a_s  # S = 1 below the first edge
        a_s = MIN_GAP_S
    if b_s <= a_s:
        return total
    xs = [a_s * (b_s / a_s) ** (i / steps) for i in range(steps + 1)]
    return total + sum((y - x) * (c.survival(x) + c.survival(y)) / 2 for x, y in pairwise(xs))


@pytest.mark.parametrize(
    ("median_s", "sigma", "message"),
    [
        (0.0, 1.0, "positive median"),
        (-1.0, 1.0, "positive median"),
        (math.inf, 1.0, "positive median"),
        (1.0, 0.0, "positive sigma"),
        (1.0, math.nan, "positive sigma"),
        (1.0, math.inf, "positive sigma"),
    ],
)
def test_a_lognormal_refuses_a_bad_median_or_sigma(
    median_s: float, sigma: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        LogNormal(median_s, sigma)


def test_survival_is_one_up_to_the_first_edge_and_flat_past_the_last() -> None:
    c = curve()
    assert c.survival(0.0) == c.survival(MIN_GAP_S) == 1.0
    assert c.at_edges[-1] != c.at_edges[-2]
    assert c.survival(MAX_GAP_S) == c.survival(10 * MAX_GAP_S) == c.at_edges[-1]
    mid = (EDGES[10] + EDGES[11]) / 2  # linear within a bin
    assert c.survival(mid) == pytest.approx((c.at_edges[10] + c.at_edges[11]) / 2)


@pytest.mark.parametrize(
    ("a_s", "b_s"),
    [
        (0.0, MIN_GAP_S / 2),  # below the bins: S = 1
        (0.0, 5.0),  # from below the bins across many
        (EDGES[20] * 1.01, EDGES[20] * 1.2),  # inside one bin
        (EDGES[20] * 1.01, EDGES[21] * 1.1),  # across one edge
        (0.5, 3600.0),  # across dozens of bins
        (MAX_GAP_S, 3 * MAX_GAP_S),  # past the last edge: flat
        (MAX_GAP_S / 2, 2 * MAX_GAP_S),  # into the flat tail
    ],
)
def test_areas_are_exact_integrals_of_the_survival_curve(a_s: float, b_s: float) -> None:
    c = curve()
    if a_s >= MAX_GAP_S:
        expected = (b_s - a_s) * c.at_edges[-1]
    elif b_s > MAX_GAP_S:
        expected = numeric_area(c, a_s, MAX_GAP_S) + (b_s - MAX_GAP_S) * c.at_edges[-1]
    else:
        expected = numeric_area(c, a_s, b_s)
    assert c.area(a_s, b_s) == pytest.approx(expected, rel=1e-6)


def test_a_blend_weighs_its_two_curves_by_trust() -> None:
    c, hint = curve(), LogNormal(2.0, 0.5)
    blend = BlendedCurve(hint, c, 0.3)
    for t in (0.1, 2.0, 40.0):
        assert blend.survival(t) == pytest.approx(0.3 * hint.survival(t) + 0.7 * c.survival(t))
    assert blend.area(0.5, 60.0) == pytest.approx(
        0.3 * hint.area(0.5, 60.0) + 0.7 * c.area(0.5, 60.0)
    )


@pytest.mark.parametrize("trust", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("window", [(0.0, 5.0), (0.5, 3600.0), (EDGES[20] * 1.01, EDGES[20] * 1.2)])
def test_a_window_is_both_survivals_and_the_area_between(
    trust: float, window: tuple[float, float]
) -> None:
    a_s, b_s = window
    c = curve()
    blend = BlendedCurve(LogNormal(2.0, 0.5), c, trust)
    for shape in (c, blend):
        got = shape.window(a_s, b_s)
        assert got == (shape.survival(a_s), shape.survival(b_s), shape.area(a_s, b_s))
    hint_area = blend.hint.area(a_s, b_s)
    assert blend.window(a_s, b_s)[2] == pytest.approx(
        trust * hint_area + (1 - trust) * numeric_area(c, a_s, b_s), rel=1e-6
    )


def test_the_bins_are_clamped_at_both_ends() -> None:
    assert bin_of(0.0) == bin_of(MIN_GAP_S) == 0
    assert bin_of(EDGES[-2]) == bin_of(MAX_GAP_S) == bin_of(2 * MAX_GAP_S) == N_BINS - 1
    assert bin_of(EDGES[5] * 1.01) == 5


def test_a_curve_at_zero_ends_every_later_bin() -> None:
    assert list(hazards([1.0, 0.5, 0.0, 0.0])) == [0.5, 1.0, 1.0]


def test_curves_and_tables_refuse_the_wrong_number_of_bins() -> None:
    with pytest.raises(ValueError):
        WaitCurve(array("d", [1.0] * N_BINS))  # one point short
    zeros = [0.0] * N_BINS
    with pytest.raises(ValueError):
        life_table(zeros, zeros, prior_hazards(PRIOR)[:-1], 10.0)


def test_with_no_data_the_table_is_its_prior() -> None:
    zeros = [0.0] * N_BINS
    table = life_table(zeros, zeros, prior_hazards(PRIOR), 10.0)
    for i in (5, 30, 50):
        assert table.at_edges[i] == pytest.approx(PRIOR.survival(EDGES[i]), abs=1e-9)
