"""Free local ports for servers a test starts (best effort: another process may still take
one between the check and the bind).

They are drawn below the kernel's ephemeral range: a port the kernel handed out for
`bind(("", 0))` is one it may hand to the next outgoing connection too (the test's own
clients, a health check), which then holds it when the server binds."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10_000
_GIVEN: set[int] = set()
"""Ports this process handed out: two blocks drawn for one server (its HTTP ports, its
control channels) are free when drawn, and must not overlap before either is bound."""


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_port() -> int:
    return free_port_block(1)


def free_port_block(n: int) -> int:
    """A port p with p .. p+n-1 all free: for workers that listen on base + i."""
    top = _ephemeral_start() - n
    for _ in range(200):
        base = random.randrange(_LOWEST, top) if top > _LOWEST else _kernel_port()
        block = range(base, base + n)
        if base + n < 65535 and _GIVEN.isdisjoint(block) and all(map(port_is_free, block)):
            _GIVEN.update(block)
            return base
    raise RuntimeError(f"no block of {n} free ports found")


def _kernel_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
