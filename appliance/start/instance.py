"""The running appliance of a data dir, found through the lock `appliance up` holds on it
(appliance/config/datadir.py: a kernel lock, so it is held exactly as long as that process lives,
and the file names its pid). `appliance stop` sends that process SIGTERM and waits until
the lock is let go, which is after it drained and stopped its workers; `appliance reload`
sends it SIGHUP and waits for its answer in `reload.json` beside the lock
(appliance/start/live_reload.py writes it). Both work the same for a foreground `appliance up`
and for the systemd service (whose ExecReload is `appliance reload`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from appliance.config.datadir import LOCK_FILE
from appliance.domain.errors import ApplianceError

RELOAD_STATUS_FILE = "reload.json"
POLL_S = 0.1


class InstanceError(ApplianceError):
    """No running appliance to signal, or it did not do what was asked in time."""

    code = "instance_error"
    exit_code = 1


def running_pid(data_dir: Path) -> int | None:
    """The pid of the appliance holding `data_dir`, or None when none holds it."""
    lock = data_dir.expanduser() / LOCK_FILE
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InstanceError(f"cannot read the lock {lock} ({exc.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder(fd, lock)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _holder(fd: int, lock: Path) -> int:
    """The pid the locked file names (written just after the lock is taken: wait for it)."""
    deadline = time.monotonic() + 2.0
    while True:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text.isdigit():
            return int(text)
        if time.monotonic() > deadline:
            raise InstanceError(f"{lock} is locked but names no pid ({text!r})")
        time.sleep(POLL_S)


def _require_pid(data_dir: Path) -> int:
    pid = running_pid(data_dir)
    if pid is None:
        raise InstanceError(
            f"no appliance is running on data dir {data_dir} (nothing holds its lock); "
            "pass the --data-dir it runs on"
        )
    return pid


def _send(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        raise InstanceError(f"the appliance (pid {pid}) has just stopped") from None
    except PermissionError:
        raise InstanceError(
            f"not permitted to signal the appliance (pid {pid}): run this as its user or "
            "root (for the service: sudo systemctl stop|reload appliance)"
        ) from None


def stop_instance(data_dir: Path, *, timeout_s: float) -> int:
    """SIGTERM to the appliance on `data_dir`, as Ctrl-C: it stops admitting, lets the
    requests in flight finish, stops its workers and exits. Returns its pid once it has
    let go of the data dir."""
    pid = _require_pid(data_dir)
    _send(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while running_pid(data_dir) == pid:
        if time.monotonic() > deadline:
            raise InstanceError(
                f"the appliance (pid {pid}) still runs {timeout_s:.0f} s after SIGTERM; it "
                f"may still be draining: wait, or end it with kill -KILL {pid}"
            )
        time.sleep(POLL_S)
    return pid


def reload_status(data_dir: Path) -> dict[str, Any] | None:
    """The appliance's answer to its last reload, or None."""
    with contextlib.suppress(OSError, ValueError):
        data = json.loads((data_dir.expanduser() / RELOAD_STATUS_FILE).read_text())
        return data if isinstance(data, dict) else None
    return None


def reload_instance(data_dir: Path, *, timeout_s: float) -> dict[str, Any]:
    """SIGHUP to the appliance on `data_dir`; its answer (what it reloaded, what changed,
    what needs a restart) once it has reloaded."""
    pid = _require_pid(data_dir)
    before = reload_status(data_dir)
    seen = before.get("reloads", 0) if before and before.get("pid") == pid else 0
    _send(pid, signal.SIGHUP)
    deadline = time.monotonic() + timeout_s
    while True:
        now = reload_status(data_dir)
        if now and now.get("pid") == pid and now.get("reloads", 0) > seen:
            return now
        if running_pid(data_dir) != pid:
            raise InstanceError(f"the appliance (pid {pid}) stopped instead of reloading")
        if time.monotonic() > deadline:
            raise InstanceError(
                f"the appliance (pid {pid}) did not answer SIGHUP in {timeout_s:.0f} s"
            )
        time.sleep(POLL_S)
