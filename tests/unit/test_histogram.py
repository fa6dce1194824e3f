"""The in-memory Prometheus histogram behind `appliance_forward_seconds`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from appliance.services.operator.histogram import PromHistogram


def exposed(h: PromHistogram, name: str) -> list[str]:
    class One(Collector):
        def collect(self):  # type: ignore[no-untyped-def]
            yield h.family(name, "What it is.")

    registry = CollectorRegistry(auto_describe=False)
    registry.register(One())
    return [
        line for line in generate_latest(registry).decode().splitlines() if not line.startswith("#")
    ]


def test_buckets_are_cumulative_and_a_value_on_a_bound_counts_in_it() -> None:
    h = PromHistogram([0.01, 0.001])
    for value in (0.0005, 0.001, 0.002, 0.5):
        h.observe(value)
    assert exposed(h, "x_seconds") == [
        'x_seconds_bucket{le="0.001"} 2.0',
        'x_seconds_bucket{le="0.01"} 3.0',
        'x_seconds_bucket{le="+Inf"} 4.0',
        "x_seconds_count 4.0",
        "x_seconds_sum 0.5035",
    ]


def test_an_empty_histogram_reads_zero() -> None:
    assert exposed(PromHistogram([1.0]), "y") == [
        'y_bucket{le="1"} 0.0',
        'y_bucket{le="+Inf"} 0.0',
        "y_count 0.0",
        "y_sum 0.0",
    ]
