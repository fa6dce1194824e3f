"""The retention connector's twin in a simulated worker: the same control channel and the
same hold book as the connector each vLLM worker loads, over the sim's block pool.

A simulated worker given a control endpoint (`appliance sim --retention-endpoint`, or the
connector's --kv-transfer-config that `appliance up --engine sim` passes worker i with
tcp://127.0.0.1:(kv_retention_base_port + i), as vLLM's launch passes it) speaks the protocol of
`appliance/engines/retention/protocol.py` as that connector does, because it runs the
connector's own worker-side modules: `channel.ControlChannel` (a DEALER on its own thread,
identity the incarnation, hello with seq 0 holding nothing), `holds.HoldBook` (what a key
last finished with, holds, the cap, the order in which holds give way) and
`plugin.RetentionTuning` (its settings). Only the pool they act on differs: `SimKvPool`
here, `vllm_pool.VllmKvPool` there. So the never-fail rules, the reports and their
reasons are the connector's, not a copy of them.

The engine calls `SimRetention` where vLLM's scheduler calls the connector (the
`RetentionHook` of residency_hook.py): `bind` with its block pool, `step_begins` at the
start of every step (directives and expiries, before any admission; an idle worker applies
them when its next request comes, as vLLM does), `admitting` for each waiting request just
before its allocation (holds given back until its prompt fits with the reserve still free,
never its own session's; none admitted after a `relieve` in the same step),
`relieve` where it would preempt (holds given back instead, the request retried next step)
and `finished` before a finished or aborted request's blocks are freed (remembered under
its `session_id`, held only when asked). Times are unix times, as in the directives,
whatever the engine's clock.

Host tier (`appliance sim --num-host-blocks`, the engine's `HostTier`): the engine copies
every cached prompt block there as vLLM's offloading connector does, so the reports carry
its size and use, and a demotion refreshes the key's copy (the engine's `copy_to_host`, its
store and touch, with their KV events "CPU") before its GPU blocks go first.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from appliance.engines.retention.channel import ControlChannel
from appliance.engines.retention.holds import Entry, HoldBook
from appliance.engines.retention.plugin import RetentionTuning
from appliance.engines.retention.protocol import (
    GiveBackReason,
    GivenBack,
    RetentionReport,
    RetentionRestore,
)
from appliance.sim.kv.block_pool import BlockPool
from appliance.sim.kv.cache_request import CacheHit, CacheRequest


class HostCopy(Protocol):
    """The engine's prefix cache, where it has a host tier (`PrefixCache`)."""

    @property
    def host(self) -> Any: ...

    def copy_to_host(self, blocks: Sequence[Any], owner: str | None) -> int: ...


class SimKvPool:
    """The sim's `BlockPool` as the hold book's `KvPool`: references and the free queue,
    as `VllmKvPool` does them on vLLM's pool; the host tier through `host`, if any."""

    def __init__(self, pool: BlockPool, host: HostCopy | None = None) -> None:
        self._pool = pool
        self._host = host

    def usable_blocks(self) -> int:
        return self._pool.num_blocks - 1  # the null block

    def free_blocks(self) -> int:
        return self._pool.num_free_blocks

    def is_cached(self, block: Any, block_hash: object) -> bool:
        return bool(block.block_hash == block_hash)

    def hold(self, blocks: Sequence[Any]) -> None:
        self._pool.touch(blocks)

    def give_back(self, blocks: Sequence[Any], *, first: bool) -> None:
        self._pool.free_blocks(reversed(blocks), first=first)

    def evict_first(self, blocks: Sequence[Any]) -> None:
        idle = [b for b in reversed(blocks) if b.ref_cnt == 0 and not b.is_null]
        queue = self._pool.free_queue
        for block in idle:
            queue.remove(block)
        queue.prepend_n(idle)

    def copy_to_host(self, blocks: Sequence[Any], key: str) -> int:
        return self._host.copy_to_host(blocks, key) if self._host is not None else 0

    def host_blocks(self) -> tuple[int, int]:
        if self._host is None:
            return 0, 0
        return self._host.host.num_blocks, len(self._host.host)

    def drop_from_host(self, block_hashes: Sequence[object]) -> int:
        if self._host is None:
            return 0
        return int(self._host.host.discard(block_hashes))

    def entries(self, block_ids: Sequence[int], num_tokens: int, block_size: int) -> list[Entry]:
        """A finished request's full blocks prefix caching can hit, with their hashes."""
        blocks = (self._pool.blocks[i] for i in block_ids[: num_tokens // block_size])
        return [(b, b.block_hash) for b in blocks if not b.is_null and b.block_hash is not None]


class SimRetention:
    """One simulated worker's end of the retention control channel (`start` opens it)."""

    def __init__(self, tuning: RetentionTuning, *, block_size: int) -> None:
        self.tuning = tuning
        self.incarnation = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._block_size = block_size
        self._pool: SimKvPool | None = None
        self._book: HoldBook | None = None
        self._reserve = 0
        self._relieved = False
        self._channel: ControlChannel | None = None
        self.restorer: Callable[[RetentionRestore], bool] | None = None
        """Carries out a restore (the worker's: the engine's prefetch from its host tier);
        without one a restore is dropped, as a connector without a host tier drops it."""

    def start(
        self, channel: ControlChannel | None = None, wake: Callable[[], None] | None = None
    ) -> None:
        """Connects to the appliance's socket, the first report (seq 0) holding nothing;
        or takes `channel` (tests: a stand-in with `directives`, `publish` and `close`).
        `wake`: called (on the channel's thread) as a directive comes, so an idle worker
        steps to apply it."""
        endpoint = self.tuning.control_endpoint
        if self._channel is not None:
            return
        if channel is None and endpoint is not None:
            interval = self.tuning.report_interval_s
            channel = ControlChannel(
                endpoint, self._report(()), report_interval_s=interval, on_directive=wake
            )
            channel.start()
        self._channel = channel

    def close(self) -> None:
        if self._book is not None:
            self._book.release_all(GiveBackReason.RESET)
            self._publish()
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    # --- the engine's calls ---

    def bind(self, pool: BlockPool, host: HostCopy | None = None) -> None:
        self._pool = SimKvPool(pool, host)
        tuning = self.tuning
        self._book = HoldBook(
            self._pool, (self._block_size,), max_held_fraction=tuning.max_held_fraction
        )
        self._reserve = max(1, int(self._pool.usable_blocks() * tuning.reserve_fraction))
        self._publish()

    def step_begins(self) -> None:
        self._relieved = False
        if self._book is None:
            return
        pending = list(self._channel.pending()) if self._channel is not None else []
        restores = [d for d in pending if isinstance(d, RetentionRestore)]
        if self._book.catch_up([d for d in pending if d not in restores], time.time()):
            self._publish()
        for restore in restores:
            if self.restorer is not None:
                self.restorer(restore)

    def admitting(self, request: CacheRequest, hit: CacheHit) -> bool:
        """Room for the whole prompt (and the token it samples) and the reserve, as the
        connector makes it: the request's own session's held blocks it hits need no room.
        False (not in this step) after a `relieve` in it, as the connector answers."""
        if self._relieved:
            return False
        if not self._book:
            return True
        own = min(self._book.held_of(request.session_id), len(hit.block_ids))
        need = -(-(request.num_tokens + 1) // self._block_size)
        if self._book.make_room(need - own + self._reserve, protect=request.session_id):
            self._publish()
        return True

    def make_room_for_restore(self, key: str, blocks: int, priority: float) -> None:
        """Room for a restore of `blocks` (and the reserve): holds of a lower priority than
        the restore's are given back, as a waiting request's would be."""
        if self._book and self._book.make_room(blocks + self._reserve, protect=key,
                                                below=priority):  # fmt: skip
            self._publish()

    def relieve(self) -> bool:
        if not self._book:
            return False
        given = self._book.relieve(self._reserve)
        if given:
            self._relieved = True
            self._publish()
        return given

    def finished(self, request: CacheRequest, block_ids: Sequence[int]) -> None:
        key = request.session_id
        if key and self._book is not None and self._pool is not None:
            entries = self._pool.entries(block_ids, request.num_computed_tokens, self._block_size)
            self._book.finished(key, (entries,))

    # --- reports ---

    def _publish(self) -> None:
        if self._book is not None:
            report = self._report(self._book.take_given_back())
            if self._channel is not None:
                self._channel.publish(report)

    def _report(self, given_back: tuple[GivenBack, ...]) -> RetentionReport:
        """The state now (seq is the channel's to number)."""
        pool, book = self._pool, self._book
        host_blocks, host_used = pool.host_blocks() if pool is not None else (0, 0)
        return RetentionReport(
            incarnation=self.incarnation,
            seq=0,
            at_s=time.time(),
            pool_blocks=pool.usable_blocks() if pool is not None else 0,
            free_blocks=pool.free_blocks() if pool is not None else 0,
            held=book.held() if book is not None else (),
            given_back=given_back,
            host_blocks=host_blocks,
            host_used_blocks=host_used,
        )
