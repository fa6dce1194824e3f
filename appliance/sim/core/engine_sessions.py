"""What a simulated engine does for a session between its turns, mixed into `SimEngine`
(`engine.py`): a held session's pinned blocks demoted or evicted (`sim/kv/pin_keeper.py`), its
newest finished prompt kept and restored from the host tier (with a retention), a branch's
blocks released on every tier when it ends.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from appliance.domain.block_hash import BlockHash
from appliance.sim.core.waiting_queue import RequestState
from appliance.sim.engine_io import SimRequest
from appliance.sim.kv.host_tier import HostTier
from appliance.sim.kv.pin_keeper import PinKeeper
from appliance.sim.kv.prefetch_lane import PrefetchLane
from appliance.sim.kv.prefix_cache import PrefixCache
from appliance.sim.kv.residency_hook import RetentionHook

LAST_PROMPTS = 4096
"""Sessions whose newest finished prompt a live engine keeps for `restore` (oldest dropped)."""


class EngineSessions:
    """The session half of `SimEngine`: pins ended its way, prompts kept for `restore`."""

    block_size: int
    cache: PrefixCache
    host: HostTier | None
    prefetches: PrefetchLane
    _retention: RetentionHook | None
    _pins: PinKeeper
    _last_prompts: OrderedDict[str, SimRequest]

    _queue_first: Callable[[list[RequestState]], None]  # `engine_batch.py`'s

    def demote(self, session_id: str) -> int:
        """Copy a held session's pinned blocks to the host tier and free them on the GPU
        (forgotten there unless someone else holds them); returns the blocks copied (0:
        the session holds none). ValueError without a host tier."""
        return self._pins.demote(session_id)

    def evict(self, session_id: str) -> int:
        """Put a held session's pinned blocks first in the GPU eviction order (still
        findable until reused); returns how many went there."""
        return self._pins.evict(session_id)

    def restore_blocks(self, session_id: str) -> int:
        """GPU blocks a `restore` of the session would take (0: nothing to copy)."""
        req = self._last_prompts.get(session_id)
        host = self.prefetches.probe(req)[1] if req is not None else 0
        return -(-host // self.block_size) if host else 0

    def restore(self, session_id: str, now: float, hold_s: float) -> bool:
        """Bring the session's newest finished prompt back into HBM from the host tier (a
        prefetch without prefill), pinned `hold_s` once there; False when there is nothing
        of it to copy, no room, or no such session."""
        req = self._last_prompts.get(session_id)
        if req is None:
            return False
        return self.prefetches.start(req, now, prefill=False, hold_s=hold_s) is not None

    def _finished(self, entry: RequestState) -> None:
        if self._retention is not None:
            self._retention.finished(entry.cache, self.cache.block_ids(entry.cache))
            sid = entry.req.session_id
            if sid is not None:
                self._last_prompts[sid] = entry.req
                self._last_prompts.move_to_end(sid)
                if len(self._last_prompts) > LAST_PROMPTS:
                    self._last_prompts.popitem(last=False)

    def release_session(self, session_id: str, own: Sequence[BlockHash], now: float) -> None:
        """A session ended (a child task's, or one whose next prompt overflows the window):
        its prefetch stops, its pin ends, and its own blocks (`own`: not its parent's, nor
        the prefix it shares with others) go on every tier."""
        self._queue_first(self.prefetches.cancel_one(now, session_id) or [])
        self.cache.end_pin(session_id, forget=own)
        if self.host is not None:
            self.host.discard(own)
