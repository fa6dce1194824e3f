"""The data directory: where the ledger, the API keys and the logs live."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
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


LOCK_FILE = "appliance.lock"


@contextlib.contextmanager
def lock_data_dir(path: Path) -> Iterator[None]:
    """Holds the data dir for one running appliance: a second one on the same dir (which
    would share its ledger and logs) is refused with the holder's pid. The lock is the
    kernel's (flock), so it goes with the process, however it ends."""
    lock = path / LOCK_FILE
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise DataDirError(
                f"data dir {path} is in use by another appliance (pid {holder}); stop it, "
                "or pass another --data-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
