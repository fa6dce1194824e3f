"""What leaves the box with an outside turn, and an outside endpoint's key: read once at
start from its environment variable, a missing one stopping the start with its name."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.config.settings_escalation import EscalationSettings
from appliance.domain.errors import ConfigError
from appliance.ledger import LedgerWriter
from appliance.services.escalation.outside_body import outside_body
from appliance.services.turns.turn_records import TurnRecords
from appliance.start.wiring_escalation import outside_escalation
from tests.fakes import ManualClock

SETTINGS = EscalationSettings.model_validate(
    {
        "endpoints": [
            {
                "name": "frontier",
                "base_url": "https://api.example.com",
                "model": "big",
                "api_key_env": "FRONTIER_KEY",
            },
        ]
    }
)


def test_only_the_model_fields_leave_the_box() -> None:
    body = {
        "model": "sim",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [],
        "temperature": 0.2,
        "max_tokens": 5,
        "stream": True,
        "session_id": "alice/s1",
        "cache_salt": "t:secret",
        "priority": -3,
        "user": "alice",
        "metadata": {"k": 1},
        "prompt_cache_key": "s1",
        "stream_options": {"include_usage": False},
    }
    sent = outside_body(body, "big")
    assert sent == {
        "model": "big",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [],
        "temperature": 0.2,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_an_endpoints_key_comes_from_its_variable_or_the_start_stops(tmp_path: Path) -> None:
    with LedgerWriter.open(tmp_path / "ledger.db") as ledger:
        records = TurnRecords(ledger, model="sim")
        with pytest.raises(ConfigError, match=r"\$FRONTIER_KEY .* is not set"):
            outside_escalation(SETTINGS, records, ManualClock(), environ={})
        built = outside_escalation(
            SETTINGS, records, ManualClock(), environ={"FRONTIER_KEY": "sk-1"}
        )
        assert built.active
        (relay,) = built.relays.values()
        assert relay.link.headers == {"Authorization": "Bearer sk-1"}
        assert "sk-1" not in repr(relay.link)
