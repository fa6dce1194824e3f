"""What every anchor policy sees and returns, and the policy protocol (see the package)."""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class AnchorRequest:
    request_id: str
    prompt_tokens: int
    session_id: str | None = None
    blocks: tuple[int, ...] = ()
    """Keys of the prompt's blocks in order (a key names its whole prefix); the last one
    covers the partial tail when `prompt_tokens` is not a multiple of `block_tokens`."""
    block_tokens: int = 16

    def block_len(self, i: int) -> int:
        """Tokens in block `i` (only the last block can be partial)."""
        return min(self.block_tokens, self.prompt_tokens - i * self.block_tokens)


@dataclass(frozen=True, slots=True)
class AnchorWorker:
    """One worker as the anchors' routers see it at decision time."""

    index: int
    url: str
    in_flight: int = 0
    """Requests this router sent there and has not seen finish (SGLang's `load()`)."""
    waiting: int = 0
    """`vllm:num_requests_waiting`."""
    kv_usage: float = 0.0
    """`vllm:kv_cache_usage_perc`, 0..1."""
    cached_blocks: int = 0
    """Leading full blocks of this prompt resident there (KV-event index)."""
    prefill_tokens: int = 0
    """Uncached prompt tokens of routed requests whose first token has not come (Dynamo)."""
    active_blocks: int = 0
    """Distinct KV blocks of routed unfinished requests (Dynamo's active sequences)."""
    shared_active_blocks: int = 0
    """How many of this prompt's full blocks are already among `active_blocks`."""
    healthy: bool = True


@dataclass(frozen=True, slots=True)
class AnchorDecision:
    worker: int
    """Index of the chosen worker (`AnchorWorker.index`)."""
    reason: str
    scores: Mapping[int, float] = field(default_factory=dict)


class AnchorPolicy(Generic[S]):
    """A routing policy whose state, of type S, the caller owns."""

    name = "anchor"

    def initial_state(self, worker_urls: Sequence[str]) -> S:
        raise NotImplementedError

    def advance(self, state: S, now: float) -> None:
        """Run the upkeep due by `now` (a source's background timer)."""

    def route(
        self, req: AnchorRequest, workers: Sequence[AnchorWorker], state: S
    ) -> AnchorDecision:
        raise NotImplementedError

    def record(self, state: S, req: AnchorRequest, decision: AnchorDecision, now: float) -> None:
        """Update the state as the source does once it has routed `req`."""


class Stateless(AnchorPolicy[None]):
    """A policy that decides from the workers' readings alone."""

    def initial_state(self, worker_urls: Sequence[str]) -> None:
        return None


def healthy_workers(workers: Sequence[AnchorWorker]) -> list[AnchorWorker]:
    alive = [w for w in workers if w.healthy]
    if not alive:
        raise ValueError("no healthy worker")
    return alive


def tie_break(req: AnchorRequest, tied: Sequence[AnchorWorker]) -> AnchorWorker:
    """A uniform-looking but repeatable pick among equals (the sources pick at random)."""
    return tied[zlib.crc32(req.request_id.encode()) % len(tied)]
