"""vLLM's KV-cache events as plain values: what the engines publish and the router's index eats.

Block hashes are the 64-bit event form (the last 8 bytes of the digest, big-endian). A batch
is what one scheduler step published under one sequence number.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Medium(StrEnum):
    GPU = "GPU"
    CPU = "CPU"
    STORAGE = "STORAGE"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = Medium.GPU
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[object, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = Medium.GPU
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    seq: int
    ts: float
    events: tuple[KvEvent, ...]
    data_parallel_rank: int | None = 0
    topic: bytes = field(default=b"")
