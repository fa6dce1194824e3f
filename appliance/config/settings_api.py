"""The API's settings (sections of appliance/config/settings.py): where it listens, who may call
it (`server.auth`), and which model names it takes for the served model (`api`)."""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, PositiveFloat, ValidationInfo, field_validator

from appliance.config.settings_section import Section


class ServerSettings(Section):
    host: str = "127.0.0.1"
    """Address the HTTP API listens on. Keep 127.0.0.1 unless a proxy with TLS fronts it."""
    port: int = Field(8080, ge=1, le=65535)
    """TCP port of the HTTP API; the engine's ports left unset follow it."""
    auth: Literal["keys", "none"] = "keys"
    """keys: every request needs an API key of api-keys.toml, which names its tenant. none:
    no key is needed (any key or none is accepted) and every request is the tenant `local`,
    with operator rights; allowed only when host is a loopback address (127.0.0.0/8, ::1,
    localhost), for unmodified clients and benchmark tools on the same machine."""
    request_timeout_s: PositiveFloat = 30.0
    """Seconds a request's head and body have to arrive, from its first byte; later: 408."""
    idle_timeout_s: PositiveFloat = 75.0
    """Seconds a kept-alive connection may wait for its next request before it is closed."""

    @field_validator("auth")
    @classmethod
    def _keyless_on_loopback_only(cls, auth: str, info: ValidationInfo) -> str:
        host = info.data.get("host")
        if auth == "none" and host is not None and not is_loopback(host):
            raise ValueError(
                f"no keys is allowed on a loopback server.host only (127.0.0.1, ::1, "
                f"localhost), not {host!r}, where any client that reaches it would need none; "
                "bind a loopback address or use auth: keys"
            )
        return auth


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ApiSettings(Section):
    """What the API accepts of clients' requests."""

    model_aliases: dict[str, str] = Field(default_factory=dict)
    """Model names clients send -> the served model (its name: engine.served_model_name or
    its default), so clients that send their own names work unchanged (Claude Code through
    ANTHROPIC_BASE_URL sends claude-... names); `*` maps any other name. Answers name the
    served model, as vLLM's do whichever of its --served-model-name a request used."""
