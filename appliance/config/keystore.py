"""API keys: `api-keys.toml` in the data dir, mode 0600, one table per key name.

A key names a tenant; an admin key also opens `/admin/*` (the console finds one here when it
runs on the same host). The file is written whole to a temporary file and renamed, so a crash
never leaves half a key file.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from appliance.domain.errors import ApplianceError

log = logging.getLogger(__name__)
KEYS_FILE = "api-keys.toml"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


class ApiKeyError(ApplianceError):
    code = "api_key_error"
    http_status = 400
    exit_code = 2


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    key: str
    admin: bool
    created_at: str


def keys_path(data_dir: Path) -> Path:
    return data_dir / KEYS_FILE


def load_keys(path: Path) -> list[ApiKey]:
    """All keys in the file; an absent file holds none."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ApiKeyError(f"{path}: cannot read the key file ({exc}); fix or remove it") from None
    keys = []
    for name, entry in data.get("keys", {}).items():
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
            raise ApiKeyError(f"{path}: key '{name}' has no 'key' string; fix or remove it")
        keys.append(
            ApiKey(
                name, entry["key"], bool(entry.get("admin", False)), str(entry.get("created_at"))
            )
        )
    return keys


def add_key(path: Path, name: str, *, admin: bool = False) -> ApiKey:
    """Generate a new key called `name` and store it; a name is used once."""
    if not _NAME.match(name):
        raise ApiKeyError(
            f"key name {name!r} is invalid: use 1-64 letters, digits, '-' or '_', starting "
            "with a letter or digit"
        )
    keys = load_keys(path)
    if any(k.name == name for k in keys):
        raise ApiKeyError(f"a key named '{name}' exists already in {path}; choose another name")
    prefix = "sk-admin-" if admin else "sk-app-"
    new = ApiKey(name, prefix + secrets.token_urlsafe(24), admin, _now())
    _write(path, [*keys, new])
    return new


def revoke_key(path: Path, name: str) -> None:
    """Remove the key called `name`; a running appliance refuses it within a second."""
    keys = load_keys(path)
    find_key(path, name, keys)
    _write(path, [k for k in keys if k.name != name])


def find_key(path: Path, name: str, keys: list[ApiKey] | None = None) -> ApiKey:
    """The key called `name` (of `keys`, else of the file); ApiKeyError naming the known
    ones when there is none."""
    keys = load_keys(path) if keys is None else keys
    found = next((k for k in keys if k.name == name), None)
    if found is None:
        known = ", ".join(k.name for k in keys) or "none"
        raise ApiKeyError(f"no key named '{name}' in {path} (keys: {known})")
    return found


class KeyFile:
    """The key file as a running appliance reads it: read again when it changes (looked at
    at most once per `check_every_s`), so `keys add` and `keys revoke` take effect without a
    restart and without dropping a session. A file that cannot be read keeps the last good
    keys, and says so in the log."""

    def __init__(
        self,
        path: Path,
        *,
        check_every_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._path = path
        self._every = check_every_s
        self._clock = clock
        self._stamp: tuple[int, int, int] | None = None
        self._checked = -float("inf")
        self._keys: list[ApiKey] = []
        self.version = 0
        """Goes up each time the keys were read anew."""

    def current(self) -> list[ApiKey]:
        now = self._clock()
        if now - self._checked >= self._every:
            self._checked = now
            self._reload()
        return self._keys

    def refresh(self) -> int:
        """Read the file again now, whatever its stamp says (`appliance reload`); the number
        of keys in effect. Raises ApiKeyError (the last good keys stay) when it is bad."""
        self._checked = self._clock()
        error = self._reload(force=True)
        if error is not None:
            raise ApiKeyError(error)
        return len(self._keys)

    def _reload(self, *, force: bool = False) -> str | None:
        try:
            st = self._path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            stamp = (0, 0, 0)
        if stamp == self._stamp and not force:
            return None
        try:
            self._keys = load_keys(self._path)
        except ApiKeyError as exc:
            log.error("API keys not reloaded, the last good ones stay: %s", exc.message)
            return exc.message
        self._stamp = stamp
        self.version += 1
        return None


def ensure_default_keys(path: Path) -> list[ApiKey]:
    """On first start: one tenant key 'default' and one operator key 'admin'."""
    keys = load_keys(path)
    if not keys:
        add_key(path, "default")
        add_key(path, "admin", admin=True)
        keys = load_keys(path)
    return keys


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _write(path: Path, keys: list[ApiKey]) -> None:
    lines = ["# API keys of the appliance: one table per key. Keep this file private (0600).", ""]
    for k in keys:
        lines += [
            f"[keys.{k.name}]",
            f'key = "{k.key}"',
            f"admin = {'true' if k.admin else 'false'}",
            f'created_at = "{k.created_at}"',
            "",
        ]
    tmp = path.with_suffix(".toml.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines))
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
