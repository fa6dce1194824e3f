"""The in-memory Prometheus histogram behind `appliance_forward_seconds`."""

from __future__ import annotations

from appliance.services.histogram import Histogram


def test_buckets_are_cumulative_and_a_value_on_a_bound_counts_in_it() -> None:
    h = Histogram([0.01, 0.001])
    for value in (0.0005, 0.001, 0.002, 0.5):
        h.observe(value)
    assert h.lines("x_seconds", "What x is.") == [
        "# HELP x_seconds What x is.",
        "# TYPE x_seconds histogram",
        'x_seconds_bucket{le="0.001"} 2',
        'x_seconds_bucket{le="0.01"} 3',
        'x_seconds_bucket{le="+Inf"} 4',
        "x_seconds_sum 0.503500",
        "x_seconds_count 4",
    ]


def test_an_empty_histogram_reads_zero() -> None:
    lines = Histogram([1.0]).lines("y", "Y.")
    assert lines[2:] == [
        'y_bucket{le="1"} 0',
        'y_bucket{le="+Inf"} 0',
        "y_sum 0.000000",
        "y_count 0",
    ]
