"""Who may call the API, and by which model names, as `appliance up` sets it (part of the
composition root): the key file's callers, read anew when it changes, or with
`server.auth: none` anyone (the settings allow it on a loopback address only) as the tenant
`local`; and `api.model_aliases`, checked against the served model before anything starts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance.api.auth import LOCAL, Caller
from appliance.config import keystore
from appliance.config.settings import Settings
from appliance.domain.errors import ConfigError
from appliance.domain.records import TenantId
from appliance.start.engine_start import served_name


def key_callers(key_file: keystore.KeyFile) -> Callable[[], dict[str, Caller]]:
    """The callers of the keys in the key file as it is now (read anew when it changes)."""
    seen: list[Any] = [None, {}]  # the file's version, its callers

    def now() -> dict[str, Caller]:
        keys = key_file.current()
        if seen[0] != key_file.version:
            seen[:] = [key_file.version, {k.key: Caller(TenantId(k.name), k.admin) for k in keys}]
        callers: dict[str, Caller] = seen[1]
        return callers

    return now


def check_aliases(settings: Settings) -> None:
    """Every alias names the served model (ConfigError, one line, otherwise)."""
    served = served_name(settings)
    for name, target in settings.api.model_aliases.items():
        if not name or target != served:
            raise ConfigError(
                f"api.model_aliases: {name!r} -> {target!r}, but the appliance serves "
                f"{served!r}; map each (non-empty) name to {served!r}"
            )


def access_note(settings: Settings, keys_file: Path) -> str:
    """What `up` says at start of how clients get in."""
    if settings.server.auth == "none":
        return f"auth: none (any key or none is the tenant '{LOCAL.tenant}', operator included)"
    return f"keys in {keys_file}"
