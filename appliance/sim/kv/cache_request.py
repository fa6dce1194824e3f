"""The prefix cache's view of one request (its tokens, their block hashes, its progress)
and what a lookup found for it (`prefix_cache.py` says how both are used)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

from appliance.domain.block_hash import (
    NO_KEYS,
    BlockHash,
    BlockHasher,
    RequestKeys,
    event_extra_keys,
)


class StoredFields(TypedDict):
    """What a BlockStored says about the request besides hashes."""

    block_size: int
    token_ids: Sequence[int]
    extra_keys: Sequence[tuple[str, ...] | None]
    session_id: str | None
    lora_id: int | None
    lora_name: str | None


class CacheRequest:
    """The prefix cache's view of one request: its tokens, their block hashes, its progress.

    Block hashes are kept up to date as output tokens are appended, like vLLM's
    `Request.block_hashes`. `num_computed_tokens` advances when `PrefixCache.allocate`
    schedules tokens and drops to 0 on preemption.
    """

    __slots__ = (
        "_hasher",
        "all_token_ids",
        "block_hashes",
        "keys",
        "lora_id",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "report_cached_blocks",
        "request_id",
        "session_id",
        "skip_reading_prefix_cache",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        hasher: BlockHasher,
        *,
        keys: RequestKeys = NO_KEYS,
        session_id: str | None = None,
        lora_id: int | None = None,
        report_cached_blocks: bool = False,
        skip_reading_prefix_cache: bool = False,
    ) -> None:
        self.request_id = request_id
        self._hasher = hasher
        self.keys = keys
        self.session_id = session_id
        self.lora_id = lora_id
        self.report_cached_blocks = report_cached_blocks
        """vLLM's `kv_cache_report_mode: "full"`: report reused blocks as BlockStored."""
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.block_hashes: list[BlockHash] = hasher.hash_blocks(self.all_token_ids, keys=keys)
        self.num_computed_tokens = 0
        self.num_preemptions = 0

    @classmethod
    def for_prompt(
        cls,
        request_id: str,
        prompt_token_ids: Sequence[int],
        hasher: BlockHasher,
        *,
        keys: RequestKeys = NO_KEYS,
        session_id: str | None = None,
        block_hashes: Sequence[BlockHash] | None = None,
    ) -> CacheRequest:
        """A request's view, its prompt hashed, unless its sender gives `block_hashes`
        (`SimRequest.block_hashes`): then nothing is hashed again."""
        if block_hashes is None:
            return cls(request_id, prompt_token_ids, hasher, keys=keys, session_id=session_id)
        out = cls(request_id, (), hasher, keys=keys, session_id=session_id)
        out.all_token_ids = list(prompt_token_ids)
        out.num_prompt_tokens = len(out.all_token_ids)
        out.block_hashes = list(block_hashes[: out.num_prompt_tokens // hasher.block_size])
        return out

    @property
    def block_size(self) -> int:
        return self._hasher.block_size

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def stored_fields(self, first_block: int, end_block: int) -> StoredFields:
        """The BlockStored fields besides hashes of its blocks [first_block, end_block)."""
        lora = self.keys.lora
        return {
            "block_size": self.block_size,
            "token_ids": self.all_token_ids,
            "extra_keys": [
                event_extra_keys(self.keys.for_block(b)) for b in range(first_block, end_block)
            ],
            "session_id": self.session_id,
            "lora_id": self.lora_id if lora is not None else None,
            "lora_name": lora.name if lora is not None else None,
        }

    def append_output(self, token_ids: Sequence[int]) -> None:
        """Append generated tokens and hash the blocks they complete."""
        self.all_token_ids.extend(token_ids)
        start = len(self.block_hashes)
        self.block_hashes.extend(
            self._hasher.hash_blocks(
                self.all_token_ids,
                keys=self.keys,
                start_block=start,
                parent=self.block_hashes[-1] if start else None,
            )
        )


@dataclass(frozen=True, slots=True)
class CacheHit:
    """The result of a lookup: the cached blocks a request can reuse from token 0."""

    block_ids: tuple[int, ...]
    num_tokens: int
    """Tokens of the GPU hit (`block_ids`)."""
    num_host_tokens: int = 0
    """Tokens right after the GPU hit that the host tier holds (to load)."""


NO_HIT = CacheHit((), 0)
