"""The ports `appliance up` will bind, settled before anything starts.

The API listens on `server.port`. Each engine port block (worker HTTP, KV events, retention
control; worker i at base + i) is the configured one, or, left unset, follows the API's
port (`PORT_OFFSETS`: 8100, 5557 and 5657 for 8080), so a second appliance on one machine
needs only its own `--port` (and data dir). Where a block that follows is taken (the first
appliance's other workers, another program), free ports are chosen for it instead, below
the kernel's ephemeral range: a port the kernel hands out for `bind(0)` may go to the next
outgoing connection before a worker binds it. The API's port and every configured block
are checked together: one error names every port in use.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

from appliance.config.settings import PORT_OFFSETS, EngineKind, Settings
from appliance.engines.errors import PortInUse
from appliance.engines.supervision.preflight import PortBlock, bind_error, check_blocks

log = logging.getLogger(__name__)
_WHAT = {
    "base_port": "HTTP of worker w{i}",
    "kv_events_base_port": "KV events of worker w{i}",
    "kv_retention_base_port": "retention control of worker w{i}",
}
_LOWEST = 10_000
_TRIES = 500


def planned_ports(settings: Settings) -> Settings:
    """`settings` with every engine port block its workers use set. Raises PortInUse naming
    every port of the API and of the configured blocks that is in use."""
    engine, n = settings.engine, settings.engine.workers
    fixed = [PortBlock("server.port", settings.server.host, settings.server.port, 1, "the API")]
    unset = []
    for key in _needed(settings):
        base: int | None = getattr(engine, key)
        if base is None:
            unset.append(key)
        else:  # the workers and the ZMQ sockets listen on loopback
            fixed.append(PortBlock(f"engine.{key}", "127.0.0.1", base, n, _WHAT[key]))
    check_blocks(fixed)
    taken = {p for b in fixed for p in range(b.base, b.base + b.count)}
    chosen: dict[str, int] = {}
    for key in unset:
        follows = settings.server.port + PORT_OFFSETS[key]
        chosen[key] = _block(follows, n, taken)
        taken.update(range(chosen[key], chosen[key] + n))
        if chosen[key] != follows:
            log.info("engine.%s: %d.. is taken; chose %d..", key, follows, chosen[key])
    return settings.model_copy(update={"engine": engine.model_copy(update=chosen)})


def _needed(settings: Settings) -> list[str]:
    """The engine port blocks the workers use (external ones: none)."""
    if settings.engine.kind == EngineKind.EXTERNAL:
        return []
    keys = list(_WHAT)
    return keys if settings.engine.kv_retention else keys[:-1]


def _block(follows: int, n: int, taken: set[int]) -> int:
    """`follows` when its n ports are all free, else a free block below the ephemeral range."""

    def usable(base: int) -> bool:
        block = range(base, base + n)
        return (
            base >= 1
            and base + n - 1 <= 65535
            and taken.isdisjoint(block)
            and all(bind_error("127.0.0.1", p) is None for p in block)
        )

    if usable(follows):
        return follows
    top = _ephemeral_start() - n
    for _ in range(_TRIES):
        base = random.randrange(_LOWEST, top)
        if usable(base):
            return base
    raise PortInUse(
        f"no {n} consecutive free ports found for the workers below {top + n}; set the "
        "engine's ports (engine.base_port, engine.kv_events_base_port, ...)"
    )


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default
