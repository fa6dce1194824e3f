"""Free local ports for servers a test starts (best effort: another process may still take
one between the check and the bind)."""

from __future__ import annotations

import socket


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_block(n: int) -> int:
    """A port p with p .. p+n-1 all free: for workers that listen on base + i."""
    for _ in range(50):
        base = free_port()
        if base + n < 65535 and all(port_is_free(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no block of {n} free ports found")
