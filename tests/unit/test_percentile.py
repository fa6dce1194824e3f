"""The reports' nearest-rank percentile, shared by the replay and the live benchmark."""

from __future__ import annotations

from appliance.domain.percentile import nearest_rank, percentile_rank


def test_the_value_at_rank_q_times_n_of_the_sorted_values() -> None:
    values = [float(v) for v in (7, 3, 9, 1, 5, 2, 8, 4, 6, 10)]  # 1..10, shuffled
    assert nearest_rank(values, 0.5) == 6.0  # rank 5 of 0..9
    assert nearest_rank(values, 0.95) == 10.0  # rank 9
    assert nearest_rank(values, 0.0) == 1.0
    assert nearest_rank(values, 0.29) == 3.0  # int(2.9): rounds down, rank 2


def test_the_top_percentile_is_the_largest_value() -> None:
    assert nearest_rank([2.0, 1.0], 1.0) == 2.0  # rank 2 is past the end: the last


def test_no_values_have_no_percentile() -> None:
    assert nearest_rank([], 0.5) is None


def test_the_rank_of_the_p95_leaves_the_top_twentieth_above_it() -> None:
    assert percentile_rank(0.95, 100) == 95
    assert percentile_rank(0.95, 19) == 18
