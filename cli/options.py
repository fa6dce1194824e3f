"""Options that several commands share, defined once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", help="YAML config file (default: $APPLIANCE_CONFIG).")
]
DataDirOpt = Annotated[
    Path | None, typer.Option("--data-dir", help="Data dir (default: $APPLIANCE_DATA_DIR).")
]
UrlOpt = Annotated[str, typer.Option("--url", help="Base URL of a running appliance.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
DEFAULT_URL = "http://127.0.0.1:8080"
