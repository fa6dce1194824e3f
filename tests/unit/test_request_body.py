"""A model request's body: JSON, an object, at most `MAX_JSON_DEPTH` levels deep; checking
the depth of a wide body costs next to nothing beside parsing it."""

from __future__ import annotations

import tracemalloc
from typing import Any

import orjson
import pytest

from appliance.api.errors import RequestRefused
from appliance.api.turns.requests import MAX_JSON_DEPTH, parse_json_body


def nested(levels: int) -> Any:
    value: Any = 1
    for i in range(levels):
        value = [value] if i % 2 else {"a": value}
    return value


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 250])
def test_a_body_nests_at_most_max_json_depth_levels(levels: int) -> None:
    raw = orjson.dumps({"x": nested(levels - 1)})  # the body itself is the first level
    if levels <= MAX_JSON_DEPTH:
        assert parse_json_body(raw) == orjson.loads(raw)
    else:
        with pytest.raises(RequestRefused) as refused:
            parse_json_body(raw)
        assert refused.value.http_status == 400 and "deeper than 100" in refused.value.message


def test_checking_a_wide_body_allocates_next_to_nothing_beside_parsing_it() -> None:
    """The depth walk used to hold a tuple for every value it had still to visit: for a
    million values in a list, about 60 MiB more than parsing it took."""
    raw = orjson.dumps({"x": [0] * 1_000_000, "y": [[]] * MAX_JSON_DEPTH})  # walked
    tracemalloc.start()
    orjson.loads(raw)
    parse_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    parse_json_body(raw)
    check_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert check_peak - parse_peak < 2**20, (parse_peak, check_peak)
