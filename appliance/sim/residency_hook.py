"""The contracts between a simulated engine and what decides where a session's KV stays:
a residency policy (the replay's), told when a request finishes or a pin comes due, whose
answer the engine carries out (`engine.py` says how); and the retention connector's twin
(`retention.py`), called where vLLM's scheduler calls its KV connector."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from appliance.domain.retention import HostTierSize
from appliance.sim.block_pool import BlockPool
from appliance.sim.cache_request import CacheHit, CacheRequest
from appliance.sim.engine_io import SimRequest
from appliance.sim.pins import Pin

KvAction = Literal["release", "hold", "evict", "demote"]


@dataclass(frozen=True, slots=True)
class TurnEnd:
    """A request that has just finished, as a residency hook sees it."""

    request: SimRequest
    resident_tokens: int
    """Tokens in the request's cached (pinnable) blocks."""
    kv_usage: float
    now_s: float
    host: HostTierSize | None = None
    """The worker's host tier (None: it has none)."""
    pins: tuple[Pin, ...] = ()
    """The worker's standing pins."""


@dataclass(frozen=True, slots=True)
class PinDue:
    """A held session whose pin has come due, as a residency hook that revisits sees it."""

    pin: Pin
    kv_usage: float
    now_s: float
    host: HostTierSize | None = None
    pins: tuple[Pin, ...] = ()


@dataclass(frozen=True, slots=True)
class AfterTurn:
    """What becomes of a finished request's cached blocks."""

    action: KvAction = "release"
    until_s: float | None = None
    """"hold" only: when the pin lapses."""


class ResidencyHook(Protocol):
    """What the engine asks about a finished request's blocks, and the order in which pins
    are given back under pressure (lowest first). A hook may also have
    `revisit(due: PinDue) -> AfterTurn` (asked for each pin as it comes due: "hold"
    extends it, "demote" or "evict" end it so, "release" lets it lapse) and
    `turn_arrived(req: SimRequest, now: float) -> None` (told of every request as it
    arrives: a session's next turn)."""

    def after_turn(self, end: TurnEnd) -> AfterTurn: ...

    def pin_priority(self, pin: Pin, now: float) -> float: ...


class RetentionHook(Protocol):
    """Where the engine calls the retention connector's twin (`retention.SimRetention`),
    at the points vLLM's scheduler calls a KV connector."""

    def bind(self, pool: BlockPool, host: Any = None) -> None:
        """The engine's block pool, once built (vLLM's `bind_gpu_block_pool`), and its
        prefix cache when that has a host tier (`PrefixCache.copy_to_host`)."""
        ...

    def step_begins(self) -> None:
        """A step starts: directives and expiries, before anything is admitted."""
        ...

    def admitting(self, request: CacheRequest, hit: CacheHit) -> bool:
        """A waiting request is about to be allocated: make room for its prompt; False:
        admit nothing more in this step (a running request's room comes first)."""
        ...

    def relieve(self) -> bool:
        """A running request is short of blocks: True when holds were given back (the
        engine retries next step instead of preempting)."""
        ...

    def finished(self, request: CacheRequest, block_ids: Sequence[int]) -> None:
        """A request finished or was aborted; its blocks are freed next."""
        ...
