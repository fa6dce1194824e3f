"""The escalation rules (policy/escalation.py): which side a turn goes to, and what an
outside turn costs at its endpoint's prices; tables of inputs and expected decisions."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from appliance.config.settings import Settings
from appliance.policy.escalation import (
    OutsidePrices,
    Side,
    SideRules,
    UnknownEndpoint,
    choose_side,
    outside_cost,
    spill_side,
)

RULES = SideRules(frozenset({"frontier", "cheap"}), {"planning": "frontier"})


@pytest.mark.parametrize(
    ("header", "task_class", "pinned", "expected"),
    [
        (None, None, None, Side(None, "local")),
        (None, "coding", None, Side(None, "local")),
        (None, "planning", None, Side("frontier", "task class planning -> frontier")),
        ("cheap", "planning", None, Side("cheap", "X-Escalate: cheap", "cheap")),
        ("local", "planning", "frontier", Side(None, "X-Escalate: local", "local")),
        (None, "planning", "local", Side(None, "task stays local (X-Escalate: local)")),
        (
            None,
            None,
            "cheap",
            Side("cheap", "task stays on cheap (an earlier turn's X-Escalate)"),
        ),
        (
            None,
            "planning",
            "cheap",
            Side("cheap", "task stays on cheap (an earlier turn's X-Escalate)"),
        ),
        (None, None, "gone", Side(None, "local")),  # an endpoint no longer configured
    ],
)
def test_the_first_rule_that_speaks_chooses_the_side(
    header: str | None, task_class: str | None, pinned: str | None, expected: Side
) -> None:
    assert choose_side(RULES, header=header, task_class=task_class, pinned=pinned) == expected


def test_a_header_that_names_no_endpoint_is_refused_with_the_names() -> None:
    with pytest.raises(UnknownEndpoint, match=r"'nope'.*local.*cheap, frontier") as err:
        choose_side(RULES, header="nope", task_class=None, pinned=None)
    assert err.value.http_status == 400


def test_a_header_with_no_endpoint_configured_says_so() -> None:
    with pytest.raises(UnknownEndpoint, match=r"\(use 'local' or one of: none configured\)$"):
        choose_side(SideRules(), header="frontier", task_class=None, pinned=None)


def test_the_header_is_ignored_when_the_config_turns_it_off() -> None:
    rules = SideRules(frozenset({"frontier"}), {}, header=False)
    assert choose_side(rules, header="frontier", task_class=None, pinned=None).endpoint is None
    assert choose_side(rules, header="nope", task_class=None, pinned=None).endpoint is None


@pytest.mark.parametrize(
    ("prompt", "cached", "output", "expected"),
    [
        (1_000_000, 0, 0, 3.0),
        (1_000_000, 400_000, 0, 0.6 * 3.0 + 0.4 * 0.3),
        (1000, 5000, 0, 1000 * 0.3 / 1e6),  # cached never exceeds the prompt
        (0, 0, 2_000_000, 30.0),
    ],
)
def test_an_outside_turn_costs_its_tokens_at_its_endpoints_prices(
    prompt: int, cached: int, output: int, expected: float
) -> None:
    prices = OutsidePrices(input_per_mtok=3.0, cached_per_mtok=0.3, output_per_mtok=15.0)
    got = outside_cost(prices, prompt_tokens=prompt, cached_tokens=cached, output_tokens=output)
    assert got == pytest.approx(expected, rel=1e-12)


ENDPOINT = {"name": "frontier", "base_url": "https://api.example.com", "model": "big"}


@pytest.mark.parametrize(
    ("escalation", "message"),
    [
        ({"endpoints": [ENDPOINT, ENDPOINT]}, "names 'frontier' twice"),
        ({"endpoints": [ENDPOINT], "task_classes": {"plan": "other"}}, "does not define"),
        ({"endpoints": [ENDPOINT | {"name": "local"}]}, "is invalid"),
        ({"endpoints": [ENDPOINT | {"base_url": "api.example.com"}]}, "must start with http"),
        ({"endpoints": [ENDPOINT | {"kind": "grpc"}]}, "kind"),
        ({"endpoints": [ENDPOINT | {"max_concurrent": 0}]}, "max_concurrent"),
    ],
)
def test_escalation_settings_that_cannot_work_are_refused(
    escalation: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(escalation=escalation)  # type: ignore[arg-type]


def test_a_complete_endpoint_is_accepted() -> None:
    s = Settings(escalation={"endpoints": [ENDPOINT], "task_classes": {"plan": "frontier"}})  # type: ignore[arg-type]
    (e,) = s.escalation.endpoints
    assert (e.kind, e.max_concurrent, e.timeout_s, e.api_key_env) == ("openai", 8, 60.0, None)


@pytest.mark.parametrize(
    ("refused", "spill_to", "room", "deadline_s", "endpoint"),
    [
        ("overloaded", "frontier", True, None, "frontier"),
        ("deadline_infeasible", "frontier", True, 2.0, "frontier"),
        ("deadline_infeasible", "frontier", True, 1.0, "frontier"),  # exactly its latency
        ("deadline_infeasible", "frontier", True, 0.5, None),  # too short for it too
        ("overloaded", "frontier", False, None, None),  # the endpoint has no room
        ("overloaded", None, True, None, None),  # no spill-over configured
        ("tenant_over_share", "frontier", True, None, None),  # the tenant's limits stand
        ("children_cap", "frontier", True, None, None),
        ("budget_exhausted", "frontier", True, 9.0, None),
    ],
)
def test_only_the_boxs_load_spills_and_only_within_the_deadline(
    refused: str, spill_to: str | None, room: bool, deadline_s: float | None, endpoint: str | None
) -> None:
    side = spill_side(refused, spill_to=spill_to, latency_s=1.0, room=room, deadline_s=deadline_s)
    assert (side.endpoint if side else None) == endpoint
    if side is not None:
        assert side.reason.startswith(f"spill-over: box refused ({refused})")
        assert side.pin is None  # a spilled turn moves alone


@pytest.mark.parametrize(
    ("deadline_s", "reason"),
    [
        (None, "spill-over: box refused (overloaded); no deadline, frontier ~1.5 s"),
        (2.25, "spill-over: box refused (overloaded); 2.25 s left, frontier ~1.5 s"),
        (1.5, "spill-over: box refused (overloaded); 1.5 s left, frontier ~1.5 s"),
    ],
)
def test_a_spilled_turns_reason_says_why_and_by_how_much(
    deadline_s: float | None, reason: str
) -> None:
    side = spill_side(
        "overloaded", spill_to="frontier", latency_s=1.5, room=True, deadline_s=deadline_s
    )
    assert side == Side("frontier", reason)
    tight = spill_side(
        "overloaded", spill_to="frontier", latency_s=1.5, room=True, deadline_s=1.4999
    )
    assert tight is None


def test_spill_to_must_name_an_endpoint() -> None:
    with pytest.raises(ValidationError, match="spill_to names endpoint 'x'"):
        Settings(escalation={"endpoints": [ENDPOINT], "spill_to": "x"})  # type: ignore[arg-type]
