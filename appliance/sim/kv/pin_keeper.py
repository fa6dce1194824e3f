"""The simulated engine's side of the residency hook (`residency_hook.py`): what becomes of
a finished request's cached blocks as the hook answers ("release", "hold", "evict",
"demote"), which pins lapse at the start of a step, what the hook says again of a pin as it
comes due, and a held session's pin demoted or evicted between steps. `sim/core/engine.py` says when
the engine calls it; without a hook a finished request's blocks are freed as vLLM frees
them."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from appliance.domain.retention import HostTierSize
from appliance.sim.core.engine_stats import EngineCounters
from appliance.sim.core.waiting_queue import RequestState
from appliance.sim.engine_io import SimRequest
from appliance.sim.kv.host_tier import HostTier
from appliance.sim.kv.pins import Pin
from appliance.sim.kv.prefix_cache import PrefixCache
from appliance.sim.kv.residency_hook import AfterTurn, PinDue, ResidencyHook, TurnEnd


def pin_owner(req: SimRequest) -> str:
    """Who a request's pin belongs to: its session, else the request itself."""
    return req.session_id if req.session_id is not None else req.request_id


class PinKeeper:
    """Carries out a residency hook's answers on one engine's prefix cache and host tier,
    counting demotions and evictions in the engine's counters."""

    def __init__(
        self,
        cache: PrefixCache,
        counters: EngineCounters,
        residency: ResidencyHook | None,
        host: HostTier | None,
    ) -> None:
        self.cache = cache
        self.host = host
        self._n = counters
        self._residency = residency
        self._revisit: Callable[[PinDue], AfterTurn] | None = getattr(residency, "revisit", None)

    def expire(self, now: float, waiting: Iterable[RequestState]) -> None:
        """Release the pins due by `now`, except those of sessions with a request waiting;
        a hook that revisits is asked about each first."""
        due = self.cache.next_pin_expiry_s()
        if due is None or due > now:
            return
        keep = {pin_owner(e.req) for e in waiting}
        if self._revisit is not None:
            for pin in self.cache.due_pins(now, keep=keep):
                self._carry_out_revisit(pin, now)
        self.cache.expire_pins(now, keep=keep)

    def _carry_out_revisit(self, pin: Pin, now: float) -> None:
        """Ask the hook again about a due pin and do what it says ("release": it lapses)."""
        assert self._revisit is not None
        due = PinDue(pin, self.cache.usage, now, self._host_size(), self.cache.pins)
        after = self._revisit(due)
        if after.action == "hold" and after.until_s is not None and after.until_s > now:
            self.cache.extend_pin(pin.owner, after.until_s)
        elif after.action == "demote" and self.host is not None:
            self.demote(pin.owner)
        elif after.action == "evict":
            self.evict(pin.owner)

    def _host_size(self) -> HostTierSize | None:
        if self.host is None:
            return None
        return HostTierSize(self.host.num_blocks, len(self.host), self.cache.pool.num_blocks - 1)

    def demote(self, session_id: str) -> int:
        """Copy a held session's pinned blocks to the host tier and free them on the GPU
        (forgotten there unless someone else holds them); returns the blocks copied (0:
        the session holds none). ValueError without a host tier."""
        n = self.cache.demote_pin(session_id)
        self._n.demotions += int(n > 0)
        return n

    def evict(self, session_id: str) -> int:
        """Put a held session's pinned blocks first in the GPU eviction order (still
        findable until reused); returns how many went there."""
        n = self.cache.evict_pin(session_id)
        self._n.evictions += int(n > 0)
        return n

    def release(self, entry: RequestState, now: float) -> None:
        """Free a finished request's blocks as the residency hook says (vLLM's free when
        there is none)."""
        creq = entry.cache
        if self._residency is None:
            self.cache.free(creq)
            return
        cached = self.cache.num_cached_held(creq)
        end = TurnEnd(
            entry.req,
            cached * self.cache.block_size,
            self.cache.usage,
            now,
            self._host_size(),
            self.cache.pins,
        )
        after = self._residency.after_turn(end)
        if after.action == "hold" and after.until_s is not None and after.until_s > now:
            self.cache.pin(pin_owner(entry.req), creq, now_s=now, until_s=after.until_s)
        elif after.action == "demote":
            if self.host is None:
                raise ValueError(
                    f"the residency hook demoted {entry.req.request_id}, but this engine has "
                    "no host tier"
                )
            self.cache.free_to_host(creq)
            self._n.demotions += 1
            return
        elif after.action == "evict":
            self.cache.free_first(creq)
            self._n.evictions += 1
            return
        self.cache.free(creq)
