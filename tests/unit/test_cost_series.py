"""The cost-per-success series: one point per window, the latest observation in it, bounded."""

from __future__ import annotations

import pytest

from appliance.services.operator.cost_series import CostSeries, overall


def test_one_point_per_window_holding_its_last_observation() -> None:
    series = CostSeries(window_s=10.0, max_points=3)
    series.observe(101.0, None, 0)
    series.observe(104.0, 0.5, 1)
    series.observe(112.0, 0.4, 2)
    assert series.points() == [
        {"window_start": 100.0, "cost_per_success": 0.5, "succeeded": 1},
        {"window_start": 110.0, "cost_per_success": 0.4, "succeeded": 2},
    ]
    for t in (125.0, 131.0, 145.0):
        series.observe(t, 0.3, 3)
    assert [p["window_start"] for p in series.points()] == [120.0, 130.0, 140.0]
    series.observe(99.0, 9.9, 9)  # the clock stepped back: nothing older is rewritten
    assert len(series) == 3 and series.points()[-1]["cost_per_success"] == 0.3


@pytest.mark.parametrize(
    ("groups", "expected"),
    [
        ([], (None, 0)),
        ([{"cost": 1.0, "succeeded": 0}], (None, 0)),
        ([{"cost": 1.0, "succeeded": 2}, {"cost": 2.0, "succeeded": 1}], (1.0, 3)),
        ([{"cost": None, "succeeded": 1}, {"cost": 0.6, "succeeded": 1}], (0.3, 2)),
    ],
)
def test_the_overall_figure_over_report_rows(
    groups: list[dict[str, object]], expected: tuple[float | None, int]
) -> None:
    assert overall(groups) == expected


def test_a_series_needs_a_window_and_room() -> None:
    with pytest.raises(ValueError):
        CostSeries(window_s=0)
    with pytest.raises(ValueError):
        CostSeries(max_points=0)
