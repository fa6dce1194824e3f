"""sd_notify over a plain AF_UNIX datagram socket (appliance/start/sdnotify.py)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from appliance.start.sdnotify import Notifier


@pytest.fixture
def listener(tmp_path: Path):  # type: ignore[no-untyped-def]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(2)
    yield sock
    sock.close()


def test_the_variables_are_taken_out_of_the_environment_the_workers_inherit() -> None:
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "30000000", "PATH": "/bin"}
    n = Notifier.from_env(env)
    assert n.address == "/run/x" and n.watchdog_s == 30.0 and n.enabled
    assert env == {"PATH": "/bin"}
    other = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}
    assert Notifier.from_env(other).watchdog_s is None  # the watchdog is another process's
    mine = {"WATCHDOG_USEC": "1000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier.from_env(mine).watchdog_s == 0.001
    assert not Notifier.from_env({}).enabled


def test_each_message_is_one_datagram(listener: socket.socket) -> None:
    n = Notifier(listener.getsockname())
    assert n.ready("serving at http://x")
    assert listener.recv(4096) == b"READY=1\nSTATUS=serving at http://x"
    assert n.reloading()
    fields = listener.recv(4096).decode().split("\n")
    assert fields[0] == "RELOADING=1" and fields[1].startswith("MONOTONIC_USEC=")
    assert int(fields[1].split("=")[1]) == pytest.approx(time.monotonic() * 1e6, abs=5e6)
    assert n.watchdog() and listener.recv(4096) == b"WATCHDOG=1"
    assert n.stopping("draining") and listener.recv(4096) == b"STOPPING=1\nSTATUS=draining"


def test_an_abstract_socket_is_written_with_an_at_sign() -> None:
    name = f"appliance-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2)
        assert Notifier("@" + name).watchdog()
        assert sock.recv(4096) == b"WATCHDOG=1"


def test_a_reader_that_lags_never_blocks_and_outside_systemd_nothing_is_sent(
    listener: socket.socket,
) -> None:
    n = Notifier(listener.getsockname())
    t0 = time.monotonic()
    sent = [n.watchdog() for _ in range(100)]  # nobody reads: the queue fills
    assert time.monotonic() - t0 < 1.0
    assert sent[0] and not sent[-1]
    assert not Notifier(None).ready("x")
