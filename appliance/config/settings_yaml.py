"""The settings as YAML: the effective configuration (`appliance config show`) and
configs/appliance.yaml, every key with its default and its docstring (a test keeps that file
equal to `documented_yaml()`)."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

from appliance.config.settings import Section, Settings


def dump_yaml(settings: Settings) -> str:
    """The effective configuration as YAML, every key shown."""
    return yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False)


def documented_yaml() -> str:
    """configs/appliance.yaml: every key with its default and its docstring as a comment."""
    lines = [
        "# The appliance's configuration: every key, its default and what it means.",
        "# Pass a copy with --config PATH (or $APPLIANCE_CONFIG); environment variables",
        "# override it: APPLIANCE_<KEY>, with __ between nested keys (APPLIANCE_SERVER__PORT).",
        "# data_dir defaults to ~/.local/share/appliance.",
    ]
    _document(Settings, Settings().model_dump(mode="json"), 0, lines)
    return "\n".join(lines) + "\n"


def _document(model: type[BaseModel], values: dict[str, Any], depth: int, out: list[str]) -> None:
    pad = "  " * depth
    for name, field in model.model_fields.items():
        if name == "data_dir":
            continue  # machine-specific default; documented in the header
        sub = field.annotation
        doc = field.description or (sub.__doc__ if isinstance(sub, type) else None)
        if doc and not (isinstance(sub, type) and issubclass(sub, Section)):
            out.append(f"{pad}# {' '.join(doc.split())}")
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            out.append("")
            out.append(f"{pad}{name}:")
            _document(sub, values[name], depth + 1, out)
        else:
            rendered = yaml.safe_dump({name: values[name]}, default_flow_style=True, width=1000)
            out.append(pad + rendered.strip().removeprefix("{").removesuffix("}"))
