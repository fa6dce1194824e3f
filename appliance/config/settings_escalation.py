"""Escalation's settings (a section of appliance/config/settings.py): the outside endpoints a turn
may go to instead of the local box, and the rules that send it there
(docs/escalation.md)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, PositiveFloat, model_validator

from appliance.config.settings_section import Section

LOCAL_SIDE = "local"
"""The name that keeps a turn on the local box (`X-Escalate: local`); no endpoint takes it."""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class OutsideEndpoint(Section):
    name: str
    """The endpoint's name in rules, the X-Escalate header and the ledger's `turns.endpoint`."""
    kind: Literal["openai", "anthropic"] = "openai"
    """openai: an OpenAI-compatible API (`POST {base_url}/v1/chat/completions` and
    `/v1/completions`); anthropic: the Anthropic Messages API (`POST {base_url}/v1/messages`,
    chat turns only, the key sent as `x-api-key`). Streamed or not, either way."""
    base_url: str
    """The API's root, without /v1 (https://api.example.com, http://127.0.0.1:9080)."""
    model: str
    """The model asked for there: every turn sent there names it in `model`."""
    api_key_env: str | None = None
    """Environment variable holding its API key, sent as `Authorization: Bearer`; read once at
    start (a variable that is not set is an error), never logged nor written to the ledger.
    None: no key is sent."""
    input_per_mtok: float = Field(0.0, ge=0)
    """Price per million prompt tokens it did not read from its cache, in costs.currency."""
    cached_per_mtok: float = Field(0.0, ge=0)
    """Price per million prompt tokens it reports cached (`prompt_tokens_details`)."""
    output_per_mtok: float = Field(0.0, ge=0)
    """Price per million output tokens."""
    max_concurrent: int = Field(8, ge=1, le=10_000)
    """Turns in flight there at once; a turn beyond it stays on the local box."""
    timeout_s: PositiveFloat = 60.0
    """Seconds it may send nothing (no answer, no next piece of a stream) before the attempt
    fails and the turn goes back to the local box."""
    latency_s: PositiveFloat = 5.0
    """Seconds it likely takes to its first token: a turn spills over to it only when its
    deadline allows that long (escalation.spill_to)."""

    @model_validator(mode="after")
    def _checked(self) -> OutsideEndpoint:
        if not _NAME.match(self.name) or self.name == LOCAL_SIDE:
            raise ValueError(
                f"escalation endpoint name {self.name!r} is invalid: use 1-64 letters, digits, "
                f"'_', '.' or '-', and not {LOCAL_SIDE!r}"
            )
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"escalation endpoint {self.name}: base_url {self.base_url!r} must start with "
                "http:// or https://"
            )
        return self


class EscalationSettings(Section):
    endpoints: list[OutsideEndpoint] = Field(default_factory=list)
    """Outside endpoints, each with name, kind, base_url, model, api_key_env, input_per_mtok,
    cached_per_mtok, output_per_mtok, max_concurrent, timeout_s, latency_s (docs/escalation.md
    has an example); none: every turn is local."""
    task_classes: dict[str, str] = Field(default_factory=dict)
    """Task class -> endpoint name: every turn of a task of that class goes there."""
    spill_to: str | None = None
    """Endpoint a turn goes to when the local box's admission refuses it as overloaded or too
    slow for its deadline, if its deadline allows the endpoint's latency_s; None: refused."""
    header: bool = True
    """Honour the `X-Escalate: <endpoint name | local>` request header (a task's turns then
    stay on the side it named until a turn names another)."""

    @model_validator(mode="after")
    def _named(self) -> EscalationSettings:
        names = [e.name for e in self.endpoints]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"escalation.endpoints names {twice[0]!r} twice: rename one")
        if self.spill_to is not None and self.spill_to not in names:
            raise ValueError(
                f"escalation.spill_to names endpoint {self.spill_to!r}, which "
                f"escalation.endpoints does not define (it has: {', '.join(names) or 'none'})"
            )
        for task_class, name in self.task_classes.items():
            if name not in names:
                raise ValueError(
                    f"escalation.task_classes.{task_class} names endpoint {name!r}, which "
                    f"escalation.endpoints does not define (it has: {', '.join(names) or 'none'})"
                )
        return self
