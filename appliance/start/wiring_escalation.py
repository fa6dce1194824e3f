"""Escalation's part of the composition root: each configured outside endpoint becomes a
relay over its HTTP client (engines/clients/outside_http.py), with its key read from its environment
variable here, once, at start (a variable that is not set stops the start with its name)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from appliance.config.settings_escalation import EscalationSettings, OutsideEndpoint
from appliance.domain.errors import ConfigError
from appliance.engines.clients.outside_http import OutsideHttp
from appliance.policy.escalation import OutsidePrices, SideRules
from appliance.ports import Clock
from appliance.services.escalation.relay import OutsideLink, OutsideRelay
from appliance.services.escalation.service import Escalation
from appliance.services.turns.turn_records import TurnRecords

ANTHROPIC_VERSION = "2023-06-01"
"""The `anthropic-version` header sent to a Messages API endpoint."""


def outside_escalation(
    settings: EscalationSettings,
    records: TurnRecords,
    clock: Clock,
    environ: Mapping[str, str] | None = None,
) -> Escalation:
    env = os.environ if environ is None else environ
    relays = {e.name: OutsideRelay(_link(e, env), records, clock) for e in settings.endpoints}
    rules = SideRules(
        frozenset(relays), dict(settings.task_classes), settings.header, settings.spill_to
    )
    return Escalation(relays, rules, clock)


def _link(e: OutsideEndpoint, env: Mapping[str, str]) -> OutsideLink:
    headers = {"anthropic-version": ANTHROPIC_VERSION} if e.kind == "anthropic" else {}
    if e.api_key_env is not None:
        key = env.get(e.api_key_env)
        if not key:
            raise ConfigError(
                f"escalation endpoint {e.name}: ${e.api_key_env} (its api_key_env) is not set; "
                "export it before `appliance up`, or remove api_key_env"
            )
        if e.kind == "anthropic":
            headers["x-api-key"] = key
        else:
            headers["Authorization"] = f"Bearer {key}"
    client = OutsideHttp(e.base_url, timeout_s=e.timeout_s, max_connections=e.max_concurrent)
    prices = OutsidePrices(e.input_per_mtok, e.cached_per_mtok, e.output_per_mtok)
    cap, latency = e.max_concurrent, e.latency_s
    return OutsideLink(e.name, e.model, client, prices, headers, cap, latency, e.kind)
