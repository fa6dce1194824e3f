"""Branch-local state in the replay: a child task's session held to its quota, its own KV
released on every tier when it ends, and the KV ended branches still hold, over time.

Model of the world (the policy: `appliance.policy.branches`): a child task of the closed
loop (`ClosedLoop.branch`) started from its parent's tokens (its prefix, or the parent's
whole conversation when the fan-out forks); its own blocks are those past them. `bound`
is the residency adapter's last word on a child's decision (the quota). When a child ends
(`task_ended`, the closed loop's event: its last turn's end, or when its client gives up
on a tool call that never answers) and `release` is on, every engine ends its pin and
drops its own blocks on every tier (`SimEngine.release_session`); its parent's blocks stay.

Measured whether or not `release` is on, so a row without it shows what it leaves: the
bytes of their own KV all ended branches still hold (pinned in HBM, or on a host tier),
sampled at each end and one reaper tick (`TICK_S`) after it (`series`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from appliance.domain.block_hash import NO_KEYS, BlockHash, RequestKeys
from appliance.perf.latency import LatencyModel
from appliance.policy.branches import Branch, BranchQuota
from appliance.policy.reaper import MIN_REVISIT_S
from appliance.policy.residency import IdleSession, ResidencyDecision
from appliance.replay.closed_loop import ClosedLoop
from appliance.sim.core.engine import SimEngine
from appliance.sim.runtime.virtual import Timer

TICK_S = MIN_REVISIT_S
"""The reaper's tick: its shortest revisit of a held session."""


@dataclass(frozen=True, slots=True)
class _Ended:
    own: frozenset[BlockHash]
    fork_blocks: int


class BranchKeeper:
    """See the module; `bind` it to the engines once they exist."""

    def __init__(
        self, loop: ClosedLoop, *, latency: LatencyModel, quota: BranchQuota | None = None
    ) -> None:
        self.loop = loop
        self.latency = latency
        self.quota = quota
        self.release = quota is not None
        """Release ended branches' own KV (the `+branches` option, which brings the quota)."""
        self.engines: Sequence[SimEngine] = ()
        self.series: list[tuple[float, int, str]] = []
        """(time, bytes of ended branches' own KV held, "end" | "tick")."""
        self._ended: dict[str, _Ended] = {}

    def bind(self, engines: Sequence[SimEngine]) -> None:
        self.engines = engines

    def bound(self, session: IdleSession, decision: ResidencyDecision) -> ResidencyDecision:
        """A child's decision, held to its quota."""
        view = self.loop.branch(session.session_id)
        if self.quota is None or view is None:
            return decision
        branch = Branch(view.task_id, view.parent_id, view.fork_tokens)
        own = self.quota.own_tokens(branch, session.resident_tokens)
        return self.quota.bound(decision, self.latency.kv_bytes(own))

    def tool_finished(self, session_id: str, now: float) -> list[Timer]:
        return []

    def task_ended(self, task_id: str, now: float) -> list[Timer]:
        view = self.loop.branch(task_id)
        if view is None or not self.engines:
            return []
        hasher = self.engines[0].hasher
        keys = RequestKeys(cache_salt=view.tenant) if view.tenant else NO_KEYS
        fork_blocks = view.fork_tokens // hasher.block_size
        own = hasher.hash_blocks(view.context, keys=keys)[fork_blocks:]
        if self.release:
            for engine in self.engines:
                engine.release_session(task_id, own, now)
        self._ended[task_id] = _Ended(frozenset(own), fork_blocks)
        self.series.append((now, self.held_bytes(), "end"))
        return [Timer(now + TICK_S, self._tick)]

    def held_bytes(self) -> int:
        """Bytes of their own KV that ended branches hold now, pinned or on a host tier."""
        ended, blocks = self._ended, 0
        hosts = {id(e.host): e.host for e in self.engines if e.host is not None}
        for engine in self.engines:
            for pin in engine.cache.pins:
                if pin.owner in ended:
                    blocks += max(0, pin.num_blocks - ended[pin.owner].fork_blocks)
        for host in hosts.values():
            blocks += sum(1 for b in ended.values() for h in b.own if h in host)
        return self.latency.kv_bytes(blocks * self.engines[0].block_size) if blocks else 0

    def summary(self) -> dict[str, object]:
        ticks = [b for _, b, kind in self.series if kind == "tick"]
        return {
            "released": self.release,
            "ended": len(self._ended),
            "held_bytes_max": max((b for _, b, _ in self.series), default=0),
            "held_bytes_max_after_tick": max(ticks, default=0),
            "series": [[round(t, 3), b, kind] for t, b, kind in self.series],
        }

    def _tick(self, now: float) -> None:
        self.series.append((now, self.held_bytes(), "tick"))
