"""Publishes KV events exactly as vLLM 0.32's ZmqEventPublisher does.

Wire: a PUB socket sends `[topic, seq (8 bytes big-endian), msgpack(EventBatch)]`; the batch is
an array `[ts, [events...], data_parallel_rank]`, each event a map tagged `"type"` with the
default-valued optional fields left out. The structs below copy vLLM's declarations field for
field, so msgspec produces the same bytes. The PUB socket binds for `*`, `::`, `ipc://` and
`inproc://` endpoints and connects otherwise (then the subscriber binds), as vLLM does. An
optional ROUTER replay socket answers `[id, b"", start_seq]` with every buffered batch from
that sequence on, then `[id, b"", b"", -1, b""]`.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from appliance.domain import kv_events as ev

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's event structs. Each tag on the wire is vLLM's class name, given explicitly:
    ours are private (`_BlockStored`) so that `domain.kv_events` alone has the public names."""


class _BlockStored(_KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class _BlockRemoved(_KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _AllBlocksCleared(_KVCacheEvent, tag="AllBlocksCleared"):
    pass


def to_wire(event: ev.KvEvent) -> _KVCacheEvent:
    if isinstance(event, ev.BlockStored):
        return _BlockStored(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=list(event.extra_keys) if event.extra_keys is not None else None,  # type: ignore[arg-type]
            group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
            session_id=event.session_id,
        )
    if isinstance(event, ev.BlockRemoved):
        return _BlockRemoved(list(event.block_hashes), event.medium, event.group_idx)
    return _AllBlocksCleared()


def encode_batch(events: list[ev.KvEvent], ts: float, data_parallel_rank: int = 0) -> bytes:
    return msgspec.msgpack.encode(_EventBatch(ts, [to_wire(e) for e in events], data_parallel_rank))


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    """Thread-safe: `publish` may be called from any thread; sends happen under a lock."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        data_parallel_rank: int = 0,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._seq = itertools.count()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        if _binds(endpoint):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._replay: zmq.Socket[Any] | None = None
        self._stop = threading.Event()
        self._replay_thread: threading.Thread | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self._replay_thread = threading.Thread(
                target=self._serve_replay, name="kv-replay", daemon=True
            )
            self._replay_thread.start()

    def publish(self, events: list[ev.KvEvent]) -> int | None:
        """Send one batch (one scheduler step); returns its sequence number. Empty: nothing."""
        if not events:
            return None
        payload = encode_batch(events, time.time(), self._rank)
        with self._lock:
            seq = next(self._seq)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
        return seq

    def _serve_replay(self) -> None:
        assert self._replay is not None
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM logs and ignores malformed requests
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            with self._lock:
                buffered = [(s, p) for s, p in self._buffer if s >= start_seq]
            for seq, payload in buffered:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2)
        if self._replay is not None:
            self._replay.close(0)
        self._pub.close(0)
