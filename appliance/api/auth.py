"""Who is calling: an API key names a tenant, and whether it is an operator's."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from appliance.api.errors import RequestRefused
from appliance.domain.records import TenantId


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: TenantId
    admin: bool


class Keys:
    """The API keys in force: `caller` names the tenant behind a request's bearer key.
    `source` gives the keys now (the key file as it is, reread when it changes)."""

    def __init__(self, source: Mapping[str, Caller] | Callable[[], Mapping[str, Caller]]) -> None:
        self._source = source if callable(source) else (lambda: source)

    def caller(self, headers: Mapping[str, str], *, admin: bool = False) -> Caller:
        """The key's caller; 401 without a known key, 403 for an operator route without an
        operator key."""
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
