"""One worker's operating-system process: spawn, log, signals to its whole group, reaping.

A worker is started in its own session, so its process group id is the pid of the process
we spawned and every process vLLM forks inherits it: one signal to the group reaches them
all. A zombie (exited, not yet reaped by its parent or by init) counts as gone: it holds no
memory, no port and no GPU. Each start appends a header line to the worker's log and then
the process's stdout and stderr; the offset after the header marks where this start's
output begins, so an error message can quote the cause of *this* start.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from contextlib import suppress
from pathlib import Path

import psutil

from appliance.engines.supervision.launch import WorkerLaunch

_CAUSE = re.compile(r"(\b\w*(Error|Exception)\b:|\bERROR\b)")


def signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Sends `sig` to every member; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, but not ours to signal
    return True


def group_members(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of the group."""
    members = []
    for proc in psutil.process_iter():
        with suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
    return members


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(group_members(pgid))


def process_running(pid: int) -> bool:
    """True while the process exists and has not exited (a zombie has)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


async def spawn(
    launch: WorkerLaunch, log_path: Path, *, waking: bool = False
) -> tuple[asyncio.subprocess.Process, int]:
    """Starts the worker in a new session (`waking`: a stopped worker's wake, with the
    launch's wake arguments), output appended to `log_path`; returns the process and the
    log offset where its output begins."""
    argv = launch.exec_argv(os.getpid(), waking=waking)
    with log_path.open("ab") as out:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        shown = " ".join(argv[4:])  # behind the trampoline's interpreter, script and config
        out.write(f"\n=== {stamp} start {launch.worker}: {shown}\n".encode())
        out.flush()
        offset = out.tell()
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=dict(launch.env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, offset


def log_cause(log_path: Path, offset: int, max_bytes: int = 64 * 1024) -> str:
    """The last line since `offset` that looks like an error, else the last line."""
    try:
        with log_path.open("rb") as f:
            f.seek(max(offset, f.seek(0, os.SEEK_END) - max_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return "no log"
    hits = [ln.strip() for ln in lines if _CAUSE.search(ln)]
    last = hits[-1] if hits else (lines[-1].strip() if lines else "no output")
    return last[:300]


async def reap_group(
    pgid: int, wait_s: float, leader: asyncio.subprocess.Process | None = None
) -> bool:
    """Waits up to `wait_s` for the group to exit by itself (vLLM's children follow their
    parent), then SIGKILLs what is left; True when nothing of it is left."""
    deadline = time.monotonic() + wait_s
    while group_alive(pgid) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    signal_group(pgid, signal.SIGKILL)
    if leader is not None:
        with suppress(ProcessLookupError):
            await leader.wait()
    deadline = time.monotonic() + 5.0
    while group_alive(pgid) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return not group_alive(pgid)


async def terminate_group(proc: asyncio.subprocess.Process, grace_s: float) -> bool:
    """SIGTERM the group, SIGKILL whatever is left after `grace_s`; True when all is gone."""
    deadline = time.monotonic() + grace_s
    signal_group(proc.pid, signal.SIGTERM)
    with suppress(TimeoutError):
        await asyncio.wait_for(proc.wait(), grace_s)
    return await reap_group(proc.pid, max(0.0, deadline - time.monotonic()), proc)
