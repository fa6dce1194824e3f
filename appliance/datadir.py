"""The data directory: where the ledger, the API keys and the logs live."""

from __future__ import annotations

import os
from pathlib import Path

from appliance.domain.errors import DataDirError


def ensure_data_dir(path: Path) -> Path:
    """Create `path` if needed and prove it writable; raise DataDirError with the fix if not."""
    path = path.expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataDirError(
            f"data dir {path}: cannot create it ({exc.strerror}); "
            "pass a writable --data-dir or set APPLIANCE_DATA_DIR"
        ) from None
    probe = path / f".write-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise DataDirError(
            f"data dir {path}: not writable ({exc.strerror}); "
            "pass a writable --data-dir or set APPLIANCE_DATA_DIR"
        ) from None
    return path
