"""`appliance up` as a user starts it, for the tests that drive a whole appliance: a real
process on free local ports with its own data dir, stopped with SIGTERM like Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import psutil
import pytest

from appliance.engines.clients.metrics import parse as parse_metrics
from tests.ports import free_port, free_port_block

T = TypeVar("T")

BIN = Path(sys.executable).parent


def add_key(data_dir: Path, name: str, *extra: str) -> str:
    out = subprocess.run(
        [str(BIN / "appliance"), "keys", "add", name, *extra, "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


@dataclass
class Started:
    url: str
    proc: subprocess.Popen[bytes]
    base_port: int
    log: Path
    ports: tuple[int, int, int]
    """(API, worker base, KV-event base): to start again on the same ports."""
    first_answer_s: float
    """From its start to the first answer of its port (`/health`: `starting` or ok)."""
    health_seen: list[str]
    """The `/health` statuses it answered while starting, each once, in order."""


@contextmanager
def appliance_process(
    data_dir: Path,
    *,
    engine: str = "sim",
    workers: int | None = 2,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    startup_s: float = 180,
    ports: tuple[int, int, int] | None = None,
    engine_ports: bool = True,
    program: Sequence[str] = (),
    stop_s: float = 60,
) -> Iterator[Started]:
    """Runs `appliance up`; on exit stops it and fails if any of its processes is left.
    `workers` None leaves the flag out (the configured default); `args` are more flags;
    `ports`: (API, worker base, KV-event base), to start again where a stopped one ran;
    `engine_ports` False sets only the API's port (the engine's follow it, or are chosen
    free: `base_port` is then 0); `program` runs the CLI instead of its script beside this
    Python (the soak's, under tracemalloc); `stop_s` is how long it may take to stop."""
    blocks = workers or 1
    port, base, kv = ports or (free_port(), free_port_block(blocks), free_port_block(blocks))
    full = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    full.update(APPLIANCE_DATA_DIR=str(data_dir))
    if engine_ports:
        full.update(
            APPLIANCE_ENGINE__BASE_PORT=str(base),
            APPLIANCE_ENGINE__KV_EVENTS_BASE_PORT=str(kv),
            APPLIANCE_ENGINE__KV_RETENTION_BASE_PORT=str(free_port_block(blocks)),
        )
    else:
        base = kv = 0
    full.update(env or {})  # the test's own win, the ports too
    argv = [*(program or [str(BIN / "appliance")]), "up", "--engine", engine, "--port", str(port)]
    if workers is not None:
        argv += ["--workers", str(workers)]
    argv += args
    log = data_dir / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=full, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    began = time.monotonic()
    deadline = began + startup_s
    first_answer_s, seen = 0.0, []
    while True:
        try:
            health = httpx.get(f"{url}/health", timeout=1)
            first_answer_s = first_answer_s or time.monotonic() - began
            status = health.json().get("status", "")
            if not seen or seen[-1] != status:
                seen.append(status)
            if health.status_code == 200:
                break
        except (httpx.HTTPError, ValueError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"appliance up did not become healthy:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)  # fine enough to time a restart (test_restart.py)
    children = psutil.Process(proc.pid).children(recursive=True)
    try:
        yield Started(url, proc, base, log, (port, base, kv), first_answer_s, seen)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=stop_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"appliance up did not stop within {stop_s:.0f} s of SIGTERM")
    time.sleep(0.5)
    left = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes left after stop: {left}"


def await_running(worker_url: str, timeout_s: float = 60.0) -> None:
    """Until the worker says it is running a request (its own /metrics)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = parse_metrics(httpx.get(f"{worker_url}/metrics", timeout=5).text)
        if metrics.total("vllm:num_requests_running") >= 1:
            return
        time.sleep(0.02)
    pytest.fail(f"{worker_url} never ran the turn")


def eventually(read: Callable[[], T], ok: Callable[[T], bool], timeout_s: float = 15.0) -> T:
    """`read()` once `ok` holds for it, or its last value after `timeout_s` (the ledger
    commits, and KV events arrive, a moment after the answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if ok(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)
