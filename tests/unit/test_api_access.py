"""Who gets in: with keys, a known key names its tenant and any other is 401; with
`server.auth: none` every request, whatever key it sends or none, is the tenant `local`
with operator rights. The model aliases must name the served model, checked at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.api.auth import LOCAL, Caller, Keys
from appliance.api.errors import RequestRefused
from appliance.config.settings_load import load
from appliance.domain.errors import ConfigError
from appliance.domain.records import TenantId
from appliance.start.access import access_note, check_aliases

ALICE = Caller(TenantId("alice"), admin=False)
HEADERS = [
    {},
    {"authorization": "Bearer EMPTY"},
    {"x-api-key": "anything"},
    {"authorization": "Bearer sk-alice"},
]


@pytest.mark.parametrize("headers", HEADERS)
def test_without_keys_every_request_is_the_local_operator(headers: dict[str, str]) -> None:
    keys = Keys({"sk-alice": ALICE}, anyone=LOCAL)
    assert keys.caller(headers) == LOCAL
    assert keys.caller(headers, admin=True) == LOCAL
    assert LOCAL.tenant == "local" and LOCAL.admin


@pytest.mark.parametrize("headers", HEADERS[:3])
def test_with_keys_an_unknown_key_or_none_is_401(headers: dict[str, str]) -> None:
    keys = Keys({"sk-alice": ALICE})
    with pytest.raises(RequestRefused) as refused:
        keys.caller(headers)
    assert refused.value.http_status == 401
    assert keys.caller({"authorization": "Bearer sk-alice"}) == ALICE


def test_aliases_must_name_the_served_model() -> None:
    check_aliases(load(api={"model_aliases": {"claude-sonnet-4-5": "sim", "*": "sim"}}))
    named = load(engine={"served_model_name": "qwen"}, api={"model_aliases": {"c": "sim"}})
    with pytest.raises(ConfigError) as err:
        check_aliases(named)
    assert err.value.exit_code == 2
    assert err.value.message == (
        "api.model_aliases: 'c' -> 'sim', but the appliance serves 'qwen'; map each "
        "(non-empty) name to 'qwen'"
    )


def test_up_says_how_clients_get_in() -> None:
    keys_file = Path("/data/api-keys.toml")
    assert access_note(load(), keys_file) == "keys in /data/api-keys.toml"
    keyless = access_note(load(server={"auth": "none"}), keys_file)
    assert keyless.startswith("auth: none") and "'local'" in keyless
