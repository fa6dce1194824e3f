"""What a worker's command line and environment need to load the retention connector, and
the connector's settings as they travel there (`kv_connector_extra_config`). Both sides
import this module: stdlib only.

The connector is `appliance.engines.retention.connector.RetentionConnector`, loaded by vLLM
through `--kv-transfer-config` with `kv_connector_module_path`. The worker's interpreter may
be another virtualenv than the appliance's, or find another checkout of the appliance; so
the worker's PYTHONPATH starts with a directory whose one entry is a link to this
appliance's own package (`plugin_path`): the worker runs the connector (and the protocol)
of the appliance that talks to it, and nothing else of the appliance's environment.
`kv_role` is `kv_producer`: a consumer role would defer block frees under async scheduling
and switch multimodal models to accept missing embeddings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

CONNECTOR_CLASS = "RetentionConnector"
CONNECTOR_MODULE = "appliance.engines.retention.connector"
PLUGIN_ENTRY = "appliance"


@dataclass(frozen=True, slots=True)
class RetentionTuning:
    """The connector's settings (`kv_connector_extra_config`)."""

    control_endpoint: str | None = None
    """The appliance's ROUTER socket; None: no control channel (nothing is ever held)."""
    max_held_fraction: float = 0.8
    """Cap on held blocks, as a share of the pool."""
    reserve_fraction: float = 0.05
    """Share of the pool holds leave free for the running requests' next blocks: an
    admission gives holds back until its prompt fits with this much still free, and a
    running request short of blocks until this much is (at least one hold)."""
    report_interval_s: float = 5.0
    """A report at least this often, changed or not."""

    def extra_config(self) -> dict[str, Any]:
        return {
            "control_endpoint": self.control_endpoint,
            "max_held_fraction": self.max_held_fraction,
            "reserve_fraction": self.reserve_fraction,
            "report_interval_s": self.report_interval_s,
        }

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> RetentionTuning:
        extra = extra or {}
        default = cls()
        return cls(
            control_endpoint=extra.get("control_endpoint") or None,
            max_held_fraction=float(extra.get("max_held_fraction", default.max_held_fraction)),
            reserve_fraction=float(extra.get("reserve_fraction", default.reserve_fraction)),
            report_interval_s=float(extra.get("report_interval_s", default.report_interval_s)),
        )


@dataclass(frozen=True, slots=True)
class RetentionLaunch:
    """The workers' connector: worker i's control channel is 127.0.0.1:(base_port + i)."""

    base_port: int
    python_path: str | None = None
    """The `plugin_path` directory, put first on each worker's PYTHONPATH."""
    tuning: RetentionTuning = RetentionTuning()

    def endpoint(self, index: int) -> str:
        return f"tcp://127.0.0.1:{self.base_port + index}"

    def kv_transfer_config(self, index: int) -> dict[str, Any]:
        tuning = replace(self.tuning, control_endpoint=self.endpoint(index))
        return {
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": tuning.extra_config(),
        }

    def pythonpath(self, current: str | None) -> str | None:
        """The worker's PYTHONPATH: `python_path` first, then what it had."""
        if self.python_path is None:
            return current
        return os.pathsep.join(p for p in (self.python_path, current) if p)


def plugin_path(directory: Path) -> Path:
    """`directory`, made to hold one entry: a link named `appliance` to this appliance's
    package. Idempotent; a stale link is replaced."""
    package = Path(__file__).resolve().parents[2]
    directory.mkdir(parents=True, exist_ok=True)
    link = directory / PLUGIN_ENTRY
    if link.is_symlink() and link.resolve() == package:
        return directory
    if link.is_symlink():
        link.unlink()
    link.symlink_to(package, target_is_directory=True)
    return directory
