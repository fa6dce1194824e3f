"""What goes into a simulated engine and what comes out of it: the request to run, the
outputs of one step for one request, and the step's result (`sim/core/engine.py` says how each is
made). Also the default choice of generated tokens."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Literal

from appliance.domain.block_hash import BlockHash
from appliance.domain.kv_events import KvEvent

FinishReason = Literal["length", "stop", "abort"]
DEFAULT_VOCAB_SIZE = 32000
"""Default generated token ids fall below this (a size every supported tokenizer exceeds)."""


@dataclass(slots=True)
class SimRequest:
    """One generation request. Lower `priority` runs first under the priority policy."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool = True
    cache_salt: str | None = None
    session_id: str | None = None
    priority: int = 0
    arrival_s: float = 0.0
    eos_after: int | None = None
    """When not `ignore_eos`: stop ("stop") after this many generated tokens."""
    block_hashes: list[BlockHash] | None = None
    """The prompt's full blocks' hashes under its `cache_salt`, when its sender has them
    (a replay of a trace that names its blocks): nothing hashes its tokens again, so a
    100k-token prompt costs its blocks, not its tokens."""


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    first_token: bool
    num_preemptions: int = 0
    """Times the request was preempted so far."""
    first_scheduled_s: float | None = None
    """The `now` of the step that first scheduled it (queue time = this - arrival)."""
    num_host_cached_tokens: int = 0
    """Of `num_cached_tokens`, those loaded from the host tier."""


@dataclass(slots=True)
class StepResult:
    duration_s: float
    """Modelled GPU time of the step; its outputs are visible at `now + duration_s`."""
    outputs: list[RequestOutput]
    events: list[KvEvent]
    """The step's KV events, oldest first: publish them as one batch."""
    num_scheduled_tokens: int
    scheduled: dict[str, int] = field(default_factory=dict)
    """Request id -> tokens scheduled in this step, in schedule order (running first)."""
    preempted: list[str] = field(default_factory=list)
    """Requests preempted (sent back to waiting) in this step."""
    idle_until_s: float | None = None
    """Set when the step only waited for host loads: when the first completes."""


def default_output_token(req: SimRequest, index: int) -> int:
    """A deterministic token id for the `index`-th generated token of `req`."""
    base = zlib.crc32(req.request_id.encode())
    return (base + 7919 * index) % DEFAULT_VOCAB_SIZE


def output_tokens(req: SimRequest, first: int, n: int) -> list[int]:
    """`default_output_token` of `req` for the `n` indices from `first`."""
    base = zlib.crc32(req.request_id.encode())
    return [(base + 7919 * index) % DEFAULT_VOCAB_SIZE for index in range(first, first + n)]
