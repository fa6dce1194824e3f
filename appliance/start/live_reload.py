"""A reload of the running appliance (SIGHUP: `appliance reload`, or systemd's ExecReload):
the API key file is read again at once, and the settings that can change while it runs are
read again from the same sources as at start (the config file, the environment it started
with, its flags) and applied: `log_level`, the prices (`costs.*`: a new price version from
now on, history keeps its own) and the admission limits (`admission.*` but `task_idle_s`).
Any other changed key is named as needing a restart and keeps its running value. A config
that does not load changes nothing but the keys, and says why.

The answer goes to `reload.json` in the data dir (appliance/start/instance.py waits for it) and to
the log.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance.config.settings import Settings
from appliance.domain.errors import ApplianceError
from appliance.start.instance import RELOAD_STATUS_FILE

log = logging.getLogger(__name__)
LIVE_SECTIONS = ("log_level", "costs", "admission")
"""What a reload applies: top-level keys or whole sections ..."""
RESTART_ONLY = frozenset({"admission.task_idle_s"})
"""... but these keys of them, which the running services read once at start."""

Applier = Callable[[Settings], object]


def flat(settings: Settings) -> dict[str, Any]:
    """Every key of the settings by its dotted name (`server.port`), JSON values."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, sub in value.items():
                walk(f"{prefix}{key}.", sub)
        else:
            out[prefix.rstrip(".")] = value

    walk("", settings.model_dump(mode="json"))
    return out


def is_live(key: str) -> bool:
    return key.split(".", 1)[0] in LIVE_SECTIONS and key not in RESTART_ONLY


class LiveReload:
    def __init__(self, started: Settings, load: Callable[[], Settings], data_dir: Path) -> None:
        self._started = flat(started)
        self._applied = dict(self._started)
        self._load = load
        self._status = data_dir / RELOAD_STATUS_FILE
        self._appliers: dict[str, Applier] = {}
        self._keys: Callable[[], int] | None = None
        self.reloads = 0

    def on_change(self, section: str, apply: Applier) -> None:
        """Call `apply(new settings)` when a key of `section` (one of LIVE_SECTIONS) changed."""
        self._appliers[section] = apply

    def on_keys(self, reread: Callable[[], int]) -> None:
        """Read the key file again at every reload; returns how many keys it holds."""
        self._keys = reread

    def run(self) -> dict[str, Any]:
        """One reload; never raises (the appliance goes on as it was where it cannot)."""
        self.reloads += 1
        answer: dict[str, Any] = {"pid": os.getpid(), "reloads": self.reloads, "at": time.time()}
        try:
            answer["keys"] = self._keys() if self._keys is not None else None
        except ApplianceError as exc:
            answer["error"] = f"API keys not reloaded: {exc.message}"
        try:
            answer |= self._settings()
        except ApplianceError as exc:
            answer["error"] = f"config not reloaded, the running one stays: {exc.message}"
        answer["ok"] = "error" not in answer
        self._write(answer)
        log.log(logging.INFO if answer["ok"] else logging.ERROR, "reload: %s", _summary(answer))
        return answer

    def _settings(self) -> dict[str, Any]:
        new = self._load()
        now = flat(new)
        applied = sorted(k for k, v in now.items() if is_live(k) and self._applied.get(k) != v)
        restart = sorted(k for k, v in now.items() if not is_live(k) and self._started.get(k) != v)
        for section in sorted({k.split(".", 1)[0] for k in applied}):
            if section in self._appliers:
                self._appliers[section](new)
        self._applied |= {k: now[k] for k in applied}
        return {"applied": applied, "restart_needed": restart}

    def _write(self, answer: dict[str, Any]) -> None:
        tmp = self._status.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(answer) + "\n")
            tmp.replace(self._status)
        except OSError as exc:
            log.error("reload: cannot write %s: %s", self._status, exc)


def _summary(answer: dict[str, Any]) -> str:
    parts = []
    if answer.get("keys") is not None:
        parts.append(f"API keys read again ({answer['keys']})")
    parts.append("applied: " + (", ".join(answer.get("applied", ())) or "no change"))
    if answer.get("restart_needed"):
        parts.append(
            "changed but taking effect only after a restart: " + ", ".join(answer["restart_needed"])
        )
    if answer.get("error"):
        parts.append(answer["error"])
    return "; ".join(parts)


def describe(answer: dict[str, Any]) -> str:
    """The answer as `appliance reload` prints it."""
    return f"reloaded the appliance (pid {answer.get('pid')}): {_summary(answer)}"
