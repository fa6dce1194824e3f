"""What the workers hold for the appliance, as plain values: a session's KV a worker's
retention connector keeps out of its eviction order (`RetainedKv`), its host tier's size
(`HostTierSize`), and a hold a worker gave back on its own or as told (`ReturnedKv`). Keys
are the sessions' retention keys, `"{tenant}/{session}"` (the `session_id` the appliance
forwards in every turn's body).
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.domain.records import WorkerId


@dataclass(frozen=True, slots=True)
class RetainedKv:
    """One key's hold in one worker, as its latest report shows it."""

    key: str
    tokens: int
    """Prefix tokens the held blocks cover."""
    until_s: float
    """Unix time at which the hold lapses on its own."""
    priority: float
    """Under pressure the lowest priority is given back first."""


@dataclass(frozen=True, slots=True)
class HostTierSize:
    """A worker's host-memory KV tier as its latest report shows it, in KV blocks."""

    blocks: int
    used_blocks: int
    gpu_blocks: int
    """The worker's GPU KV pool, for the host tier's size against it (0: unknown)."""

    @property
    def turnover(self) -> float:
        """The tier's size over the GPU pool's (1 when that is unknown)."""
        return self.blocks / self.gpu_blocks if self.gpu_blocks > 0 else 1.0


@dataclass(frozen=True, slots=True)
class ReturnedKv:
    """A hold a worker gave back (`reason`: released, expired, pressure, capped, evicted,
    not_found, reset; see `appliance.engines.retention.protocol.GiveBackReason`)."""

    worker: WorkerId
    key: str
    blocks: int
    reason: str
