"""Subscribes to a vLLM worker's KV events and hands decoded batches to the caller.

One subscriber per worker, on its own thread. Sequence numbers are checked: a gap is filled
from the worker's replay socket when it has one (a DEALER asks `[b"", start_seq]` and reads
batches until the end marker, seq -1); a sequence that goes backwards means the engine
restarted, so the caller is told to forget that worker's blocks before the new ones arrive.
Events are accepted both as maps (vLLM >= 0.26) and as positional arrays (older releases);
unknown keys are ignored and missing ones read as null. Block hashes arrive as uint64 or,
with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, as raw digests, of which the last 8 bytes count.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from appliance.domain import kv_events as ev

log = logging.getLogger(__name__)
_MASK = (1 << 64) - 1
_END_SEQ = -1

# Positional layouts of events before map encoding (vLLM <= 0.23), after the type tag.
_ARRAY_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    "AllBlocksCleared": (),
}


def _hash(value: Any) -> int:
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(bytes(value)[-8:], "big")
    return int(value) & _MASK


def decode_event(raw: Any) -> ev.KvEvent | None:
    """One event from its wire form (map or array); None for a type this build does not know."""
    if isinstance(raw, list | tuple):
        if not raw:
            return None
        kind, values = raw[0], raw[1:]
        fields: dict[str, Any] = dict(zip(_ARRAY_FIELDS.get(kind, ()), values, strict=False))
    elif isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    else:
        return None
    if kind == "BlockStored":
        parent = fields.get("parent_block_hash")
        extra = fields.get("extra_keys")
        return ev.BlockStored(
            block_hashes=tuple(_hash(h) for h in fields.get("block_hashes") or ()),
            parent_block_hash=_hash(parent) if parent is not None else None,
            token_ids=tuple(fields.get("token_ids") or ()),
            block_size=int(fields.get("block_size") or 0),
            medium=fields.get("medium"),
            lora_id=fields.get("lora_id"),
            lora_name=fields.get("lora_name"),
            extra_keys=tuple(extra) if extra is not None else None,
            group_idx=fields.get("group_idx"),
            kv_cache_spec_kind=fields.get("kv_cache_spec_kind"),
            session_id=fields.get("session_id"),
        )
    if kind == "BlockRemoved":
        return ev.BlockRemoved(
            block_hashes=tuple(_hash(h) for h in fields.get("block_hashes") or ()),
            medium=fields.get("medium"),
            group_idx=fields.get("group_idx"),
        )
    if kind == "AllBlocksCleared":
        return ev.AllBlocksCleared()
    return None


def decode_batch(topic: bytes, seq_bytes: bytes, payload: bytes) -> ev.KvEventBatch:
    seq = int.from_bytes(seq_bytes, "big", signed=True)
    raw = msgspec.msgpack.decode(payload)
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    decoded = tuple(e for e in (decode_event(r) for r in events) if e is not None)
    return ev.KvEventBatch(
        seq=seq, ts=float(ts), events=decoded, data_parallel_rank=rank, topic=topic
    )


def _publisher_binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventSubscriber:
    """Receives one worker's batches on a thread; `on_batch` runs there, in sequence order.

    `on_reset` runs before the first batch of a restarted engine (its sequence went back) and
    when a gap could not be filled: the caller then forgets what it knew of this worker, since
    a stale index may cost cache hits but must never claim blocks that are gone.
    """

    def __init__(
        self,
        endpoint: str,
        on_batch: Callable[[ev.KvEventBatch], None],
        *,
        on_reset: Callable[[str], None] | None = None,
        replay_endpoint: str | None = None,
        topic_prefix: bytes = b"",
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self._on_batch = on_batch
        self._on_reset = on_reset or (lambda reason: None)
        self._replay_endpoint = replay_endpoint
        self.last_seq: int | None = None
        self.gaps_filled = 0
        self.gaps_lost = 0
        self.resets = 0
        self._stop = threading.Event()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic_prefix)
        # vLLM connects to plain tcp endpoints, so the appliance owns (binds) them.
        if _publisher_binds(endpoint):
            self._sub.connect(endpoint.replace("*", "127.0.0.1"))
        else:
            self._sub.bind(endpoint)
        self.endpoint = endpoint
        self._thread = threading.Thread(target=self._run, name=f"kv-sub {endpoint}", daemon=True)

    def start(self) -> KvEventSubscriber:
        self._thread.start()
        return self

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._sub.recv_multipart()
            if len(frames) != 3:
                log.warning("KV event with %d frames from %s ignored", len(frames), self.endpoint)
                continue
            try:
                self._accept(decode_batch(*frames))
            except Exception:
                log.exception("bad KV event batch from %s", self.endpoint)
        self._sub.close(0)

    def _accept(self, batch: ev.KvEventBatch) -> None:
        last = self.last_seq
        if last is not None and batch.seq <= last:
            self.resets += 1
            self._on_reset("engine restarted: sequence went back")
        elif last is not None and batch.seq > last + 1:
            self._fill_gap(last + 1, batch.seq)
        self._deliver(batch)

    def _deliver(self, batch: ev.KvEventBatch) -> None:
        self.last_seq = batch.seq
        self._on_batch(batch)

    def _fill_gap(self, start: int, upto: int) -> None:
        replayed = self._replay(start) if self._replay_endpoint else []
        got = [b for b in replayed if start <= b.seq < upto]
        if [b.seq for b in got] == list(range(start, upto)):
            self.gaps_filled += 1
            for b in got:
                self._deliver(b)
            return
        self.gaps_lost += 1
        self._on_reset(f"lost KV events {start}..{upto - 1}")

    def _replay(self, start: int, timeout_ms: int = 2000) -> list[ev.KvEventBatch]:
        assert self._replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._replay_endpoint.replace("*", "127.0.0.1"))
        batches: list[ev.KvEventBatch] = []
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while sock.poll(timeout_ms):
                frames = sock.recv_multipart()
                # 0.32: [b"", topic, seq, payload]; older releases: [b"", seq, payload].
                body = frames[1:]
                if len(body) == 2:
                    body = [b"", *body]
                topic, seq_bytes, payload = body
                if int.from_bytes(seq_bytes, "big", signed=True) == _END_SEQ:
                    break
                batches.append(decode_batch(topic, seq_bytes, payload))
        finally:
            sock.close(0)
        return batches

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        else:
            self._sub.close(0)
