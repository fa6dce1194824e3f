"""A simulated worker's endpoints as vLLM sets them: a free port for `tcp://*:0`, and the
per-rank offset of data parallelism."""

from __future__ import annotations

import socket


def resolve_endpoint(endpoint: str | None) -> str | None:
    """`tcp://*:0` binds a free port, reported as `tcp://*:<port>` (vLLM binds and reports
    the node IP there; a subscriber connects to either)."""
    if endpoint and endpoint.startswith("tcp://*:") and endpoint.endswith(":0"):
        return f"tcp://*:{free_port()}"
    return endpoint


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """vLLM's per-rank endpoint: port + rank (port 0 left to the OS; inproc gets a suffix)."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    head, sep, port = endpoint.rpartition(":")
    if sep and port.isdigit() and int(port) != 0:
        return f"{head}:{int(port) + rank}"
    return endpoint


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
