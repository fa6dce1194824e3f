"""The retention control channel's messages: the appliance's directives to a worker's
connector, and the connector's reports back. msgpack of tagged msgspec structs; this
module imports neither vLLM nor the rest of the appliance, since both sides load it.

Keys: a hold is keyed by the `session_id` of the request vLLM finished, which is the one
the appliance forwards in every turn's body (`"{tenant}/{session}"`); the connector keeps,
per key, the full prefix-cached blocks of the newest finished request, without holding
them, until a directive names the key.

Directives (appliance -> worker), applied in order on the scheduler thread at its next step,
before that step admits anything (an idle worker applies them when its next request comes:
nothing is evicted without a step); the report that shows them follows:
- `RetentionHold(key, until_s, priority)`: hold the key's newest finished request's
  cached blocks until `until_s` (unix time). On a held key it extends the hold and takes
  the new priority, and moves the hold to a newer finished request if there is one.
- `RetentionRelease(key)`: stop holding; the blocks become ordinary cached blocks, LRU.
- `RetentionEvictFirst(key, keep_blocks, drop_host)`: stop holding, and put the key's blocks
  nobody uses, past its first `keep_blocks` (released as LRU), at the head of the free
  queue, so they are evicted before any other; `drop_host`: their copies in the host tier
  are dropped at once too (a fan-out branch that ended: its own KV reclaimed on every tier).
- `RetentionDemote(key)`: stop holding, make sure the key's blocks have a copy in the
  worker's host tier (vLLM's native offloading stores every cached prompt block there as it
  is computed; the simulated host tier does the same, and the demotion refreshes the copy
  as the most recently used), then evict them first on the GPU, as `RetentionEvictFirst`.
  The appliance sends it only to a worker whose reports show a host tier.
- `RetentionRestore(key, until_s, priority)`: bring the key's newest finished request's
  prompt back into HBM from the worker's host tier (the part past what HBM still has: its
  blocks allocated now, cached when the host -> GPU copy lands) ahead of the session's next
  turn, and keep it there until `until_s` (a hold of that priority; the next turn takes it
  over). The simulated workers do it (their host tier's prefetch); a vLLM worker's connector
  makes the key's host copies the tier's most recently used, and the key's next request
  loads them back (vLLM loads only for a request); a connector without a host tier ignores
  it, and the appliance sends it only where reports show one.
- `RetentionOrder(priorities)`: new priorities for held keys. Under pressure the connector
  gives holds back lowest priority first (ties: the oldest hold first).
- `RetentionQuery()`: answer with the latest report now (from the channel's thread).

Reports (worker -> appliance): the whole state each time (`held`, and the host tier's size
and use in blocks: 0 without one), plus what was given back since the previous report
(`given_back`, with a reason). A connector's first report has
`seq` 0 and holds nothing: a new `incarnation` means the worker restarted and held
nothing when it did.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec


class RetentionHold(msgspec.Struct, tag="hold", frozen=True):
    key: str
    until_s: float
    """Unix time at which the hold lapses on its own."""
    priority: float = 0.0
    """Under pressure the lowest priority is given back first."""


class RetentionRelease(msgspec.Struct, tag="release", frozen=True):
    key: str


class RetentionEvictFirst(msgspec.Struct, tag="evict_first", frozen=True):
    key: str
    keep_blocks: int = 0
    """Leading blocks left to LRU (a branch's inherited prefix, which its parent uses)."""
    drop_host: bool = False
    """The other blocks' copies leave the host tier at once too (a branch that ended)."""


class RetentionDemote(msgspec.Struct, tag="demote", frozen=True):
    key: str


class RetentionRestore(msgspec.Struct, tag="restore", frozen=True):
    key: str
    until_s: float
    """Unix time until which the restored blocks are kept."""
    priority: float = 0.0


class RetentionOrder(msgspec.Struct, tag="order", frozen=True):
    priorities: dict[str, float]


class RetentionQuery(msgspec.Struct, tag="query", frozen=True):
    pass


RetentionDirective = (
    RetentionHold
    | RetentionRelease
    | RetentionEvictFirst
    | RetentionDemote
    | RetentionRestore
    | RetentionOrder
    | RetentionQuery
)


class GiveBackReason(StrEnum):
    RELEASED = "released"
    """The appliance released it."""
    EXPIRED = "expired"
    """Its `until_s` passed."""
    PRESSURE = "pressure"
    """A request needed the room (admission, or a running request short of blocks)."""
    CAPPED = "capped"
    """A newer hold needed room under the cap on held blocks."""
    EVICTED = "evicted"
    """The appliance marked it first to evict."""
    DEMOTED = "demoted"
    """The appliance demoted it to the host tier (its GPU blocks then go first)."""
    NOT_FOUND = "not_found"
    """A hold was asked for, but nothing of the key's last request is cached (or this
    worker never ran one)."""
    RESET = "reset"
    """The prefix cache was reset or the engine is shutting down."""


class HeldKv(msgspec.Struct, frozen=True):
    key: str
    blocks: int
    tokens: int
    """Prefix tokens the held blocks cover."""
    until_s: float
    priority: float


class GivenBack(msgspec.Struct, frozen=True):
    key: str
    blocks: int
    reason: GiveBackReason


class RetentionReport(msgspec.Struct, tag="report", frozen=True):
    incarnation: str
    """Chosen at the connector's start: a new one means a restarted worker."""
    seq: int
    """0 for the first report of an incarnation, then +1 per report."""
    at_s: float
    """Unix time of the state it shows."""
    pool_blocks: int
    """Usable KV blocks (0 until vLLM has bound its block pool)."""
    free_blocks: int
    """Free or evictable blocks."""
    held: tuple[HeldKv, ...] = ()
    given_back: tuple[GivenBack, ...] = ()
    host_blocks: int = 0
    """Blocks the worker's host tier holds at most (0: it has none)."""
    host_used_blocks: int = 0
    """Blocks in the host tier now (a cache: full once warm, it evicts to make room)."""

    @property
    def held_blocks(self) -> int:
        return sum(h.blocks for h in self.held)


_directives = msgspec.msgpack.Decoder(RetentionDirective)
_reports = msgspec.msgpack.Decoder(RetentionReport)
_encoder = msgspec.msgpack.Encoder()


def encode_retention(message: RetentionDirective | RetentionReport) -> bytes:
    return _encoder.encode(message)


def decode_directive(data: bytes) -> RetentionDirective:
    """Raises msgspec.DecodeError (a ValueError) on anything else."""
    return _directives.decode(data)


def decode_report(data: bytes) -> RetentionReport:
    return _reports.decode(data)
