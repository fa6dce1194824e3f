"""Tenant isolation of the prefix cache: a per-tenant `cache_salt` derived from a secret.

vLLM mixes `cache_salt` into the hash of a prompt's first block, so two tenants sending the
same prompt never share a cache entry. The salt is an HMAC of the tenant name under the
appliance's secret (a client cannot guess another tenant's salt), with the client's own
salt, if any, appended so a client can isolate further but never less.
"""

from __future__ import annotations

import hashlib
import hmac


class TenantSalts:
    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("the tenant-salt secret needs at least 16 bytes")
        self._secret = secret
        self._cache: dict[str, str] = {}

    def __call__(self, tenant: str, client_salt: str | None = None) -> str:
        base = self._cache.get(tenant)
        if base is None:
            digest = hmac.new(self._secret, tenant.encode(), hashlib.sha256).hexdigest()[:32]
            base = self._cache[tenant] = f"t:{digest}"
        return f"{base}:{client_salt}" if client_salt else base
