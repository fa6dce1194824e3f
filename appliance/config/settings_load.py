"""The settings built from their sources, strongest first: explicit values (CLI flags),
environment variables (`APPLIANCE_` prefix, `__` between nested keys), the YAML file
(`--config PATH` or `$APPLIANCE_CONFIG`), then the defaults of appliance/config/settings.py. A bad
key or value is one line naming the key, the value and the fix. A renamed key of the file
(`RENAMED`) still works under its old name, with one warning line."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_settings import EnvSettingsSource

from appliance.config.settings import ENV_PREFIX, Settings
from appliance.domain.errors import ConfigError

log = logging.getLogger(__name__)

RENAMED = {"reaper": "worker_reaper"}
"""Old top-level key of the file -> its new name (the idle reaper is `residency.reaper`)."""


def load(config_file: Path | None = None, **flags: Any) -> Settings:
    """Build the settings: defaults, then the YAML file, then the environment, then `flags`.

    `flags` are CLI values for top-level keys or nested dicts for sections; None means "not
    given" and never hides the file or the environment. Raises ConfigError with one line that
    names the key, the value and the fix.
    """
    path = config_file or _env_config_path()
    _check_env_keys()
    file = _renamed(_read_yaml(path), path) if path else {}
    layers = [file, EnvSettingsSource(Settings)(), _given(flags)]
    values: dict[str, Any] = {}
    for layer in layers:
        _deep_merge(values, layer)
    try:
        return Settings(**values)
    except ValidationError as exc:
        raise ConfigError(_one_line(exc, path)) from None


def _given(flags: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flags.items():
        if isinstance(value, dict):
            value = _given(value)
        if value is not None and value != {}:
            out[key] = value
    return out


def _deep_merge(into: dict[str, Any], other: dict[str, Any]) -> None:
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


def _env_config_path() -> Path | None:
    raw = os.environ.get(ENV_PREFIX + "CONFIG")
    return Path(raw) if raw else None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(
            f"config file {path}: {exc.strerror}; pass an existing --config"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {path}{where}: not valid YAML; fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path}: must be a mapping of keys, not {type(data).__name__}"
        )
    return data


def _renamed(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """`data` with each old key of `RENAMED` under its new name, and a warning for each."""
    for old, new in RENAMED.items():
        if old not in data:
            continue
        if new in data:
            raise ConfigError(f"config file {path}: both '{old}' and '{new}'; keep only '{new}'")
        log.warning("config file %s: '%s' is now '%s'; rename the key", path, old, new)
        data[new] = data.pop(old)
    return data


# Environment variables the appliance reads itself rather than as settings keys.
_NON_SETTING_ENV = {"CONFIG", "VLLM_PYTHON", "TEST_CACHE"}


def _check_env_keys() -> None:
    """An APPLIANCE_* variable that names no setting is a typo: say so instead of ignoring it."""
    for name in os.environ:
        if not name.startswith(ENV_PREFIX):
            continue
        parts = name[len(ENV_PREFIX) :].lower().split("__")
        if parts[0].upper() in _NON_SETTING_ENV:
            continue
        if parts[0] in RENAMED:
            new = ENV_PREFIX + "__".join([RENAMED[parts[0]], *parts[1:]]).upper()
            raise ConfigError(f"environment {name}: renamed; set {new} instead")
        model: type[BaseModel] | None = Settings
        for part in parts:
            fields = model.model_fields if model else {}
            if part not in fields:
                raise ConfigError(
                    f"environment {name}: unknown key '{'.'.join(parts)}'; "
                    "see `appliance config show` for the known keys"
                )
            annotation = fields[part].annotation
            model = (
                annotation
                if isinstance(annotation, type) and issubclass(annotation, BaseModel)
                else None
            )


def _one_line(exc: ValidationError, path: Path | None) -> str:
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"]) or "(root)"
    value = err.get("input")
    source = f"config {path}" if path else "config"
    if err["type"] == "extra_forbidden":
        return f"{source}: unknown key '{key}'; remove it or check configs/appliance.yaml"
    message = err["msg"].removeprefix("Value error, ")
    about = _describe(tuple(str(p) for p in err["loc"]))
    fix = f"; expected: {' '.join(about.split())}" if about else ""
    return f"{source}: {key}={value!r} is invalid: {message}{fix}"


def _describe(loc: tuple[str, ...]) -> str | None:
    """The docstring of the field at `loc`, the best one-line hint of what a key wants."""
    model: type[BaseModel] = Settings
    description = None
    for part in loc:
        field = model.model_fields.get(part)
        if field is None:
            break
        description = field.description
        if not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            break
        model = field.annotation
    return description
