"""Who is calling: an API key names a tenant, and whether it is an operator's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from appliance.api.errors import ApiError
from appliance.domain.records import TenantId


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: TenantId
    admin: bool


class Keys:
    """The API keys in force: `caller` names the tenant behind a request's bearer key."""

    def __init__(self, keys: Mapping[str, Caller]) -> None:
        self._keys = keys

    def caller(self, headers: Mapping[str, str], *, admin: bool = False) -> Caller:
        """The key's caller; 401 without a known key, 403 for an operator route without an
        operator key."""
        auth = headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        who = self._keys.get(key.strip()) if scheme.lower() == "bearer" else None
        if who is None:
            raise ApiError(
                401,
                "missing or unknown API key: send 'Authorization: Bearer <key>'",
                "invalid_api_key",
            )
        if admin and not who.admin:
            raise ApiError(403, "this route needs an operator key", "not_admin")
        return who
