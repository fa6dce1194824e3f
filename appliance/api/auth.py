"""Who is calling: an API key names a tenant, and whether it is an operator's; with
`server.auth: none` (loopback only) every request is `LOCAL`, whatever key it sends."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from appliance.api.errors import RequestRefused
from appliance.domain.records import TenantId


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: TenantId
    admin: bool


LOCAL = Caller(TenantId("local"), admin=True)
"""The caller of every request when no key is needed (`server.auth: none`)."""


class Keys:
    """The API keys in force: `caller` names the tenant behind a request's bearer key.
    `source` gives the keys now (the key file as it is, reread when it changes); `anyone`,
    when given, is every request's caller, with any key or none."""

    def __init__(
        self,
        source: Mapping[str, Caller] | Callable[[], Mapping[str, Caller]],
        *,
        anyone: Caller | None = None,
    ) -> None:
        self._source = source if callable(source) else (lambda: source)
        self._anyone = anyone

    def caller(self, headers: Mapping[str, str], *, admin: bool = False) -> Caller:
        """The key's caller; 401 without a known key, 403 for an operator route without an
        operator key."""
        if self._anyone is not None:
            return self._anyone
        auth = headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer":  # Anthropic's clients send theirs as x-api-key
            key = headers.get("x-api-key", "") if not auth else ""
        who = self._source().get(key.strip()) if key else None
        if who is None:
            raise RequestRefused(
                401,
                "missing or unknown API key: send 'Authorization: Bearer <key>' (or x-api-key)",
                "invalid_api_key",
            )
        if admin and not who.admin:
            raise RequestRefused(403, "this route needs an operator key", "not_admin")
        return who
