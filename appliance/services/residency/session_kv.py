"""Where a session's KV is now, and what was decided about it: what the state and the
operators' session routes show.

Model of the world: a session's last prompt is a chain of full blocks. Each worker holds a
leading part of it, or none, in each tier: the KV index says how much from the workers' KV
events (GPU, host); the workers' retention connectors say how much of the GPU part a hold
keeps out of the engine's eviction order, and until when (their latest reports). So per
worker the prefix is split into GPU held until T, GPU unheld (cached, evicted when the
engine needs room, least recently used first), host, and gone (the rest). The decision shown
is an operator's release while it lasts (until the session's next turn), else the idle
reaper's standing one; without one, why there is none (`undecided_reason`): a turn in
flight, or a prompt under one block, which leaves nothing cached to decide on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from appliance.domain.records import TaskId, WorkerId
from appliance.services.operator.session_admin import RELEASE_REASON, RELEASED, SessionReleases
from appliance.services.residency.branch_kv import BranchReclaim
from appliance.services.residency.reaper_loop import ReaperLoop
from appliance.services.residency.residency_inputs import prefix_tokens, retention_key
from appliance.services.sessions.sessions import SessionState

NO_DECISION_REASON = "no residency decision yet: no turn of it has ended, or one just did"
IN_FLIGHT_REASON = "no residency decision while a turn is in flight"
UNDER_ONE_BLOCK = "nothing cached: prompt under one block"
"""Why a session whose prompt fills no KV block gets no decision: nothing of it is cached
(vLLM caches full blocks only), so the idle reaper has nothing to hold or release."""
REAPER_OFF_REASON = "the idle reaper is off (residency.reaper): the engine's LRU decides"
Index = Callable[[SessionState], Mapping[str, Mapping[WorkerId, int]]]
"""The session's prefix as the KV index holds it now: tier ("gpu", "host") -> worker ->
leading tokens (`Placer.residency`)."""


@dataclass(frozen=True, slots=True)
class WorkerKv:
    """One worker's part of a session's prefix, in tokens."""

    worker: WorkerId
    gpu: int
    """On its GPU, held or not."""
    held: int
    """Of `gpu`, what its retention connector holds."""
    held_until: float | None
    host: int
    gone: int
    """Of the prefix, what it has on neither tier."""


@dataclass(frozen=True, slots=True)
class SessionKvNow:
    workers: list[WorkerKv]
    """Every worker with a part of the prefix, and the session's home; by worker id."""
    decision: str | None
    reason: str

    def most(self) -> dict[str, int]:
        """Per tier, the most any one worker has (gone: the least any worker lacks)."""
        w = self.workers
        return {
            "gpu": max((x.gpu for x in w), default=0),
            "host": max((x.host for x in w), default=0),
            "gpu_held": max((x.held for x in w), default=0),
            "gone": min((x.gone for x in w), default=0),
        }

    @property
    def held_until(self) -> float | None:
        return max((x.held_until for x in self.workers if x.held_until), default=None)


class SessionKv:
    def __init__(
        self,
        index: Index,
        releases: SessionReleases | None = None,
        reaper: ReaperLoop | None = None,
    ) -> None:
        """`reaper`: the idle reaper's loop (its decisions, and the workers' holds through
        its retention port); None: it is off."""
        self._index = index
        self.releases = releases
        self._reaper = reaper
        self._retention = reaper.retention if reaper is not None else None

    def status(self) -> dict[str, Any]:
        """The idle reaper at a glance (`/admin/v1/state` "residency")."""
        if self._reaper is None:
            return {"reaper": False, "retention": False, "note": REAPER_OFF_REASON}
        return self._reaper.status()

    def watched(self) -> list[SessionState]:
        """Sessions the idle reaper still watches: idle ones, and those whose task closed
        (gone from the session table) until their KV is gone."""
        waiting = self._reaper.waiting_sessions() if self._reaper is not None else {}
        return [w.session for w in waiting.values()]

    def branch_end(self, task: TaskId) -> BranchReclaim | None:
        """What the task's end reclaimed (None: not ended, forgotten, or no reaper)."""
        return self._reaper.branch_ends.get(task) if self._reaper is not None else None

    def now(self, session: SessionState) -> SessionKvNow:
        tiers = self._index(session)
        gpu, host = tiers.get("gpu", {}), tiers.get("host", {})
        workers = {w for w, n in (*gpu.items(), *host.items()) if n > 0}
        if session.home is not None:
            workers.add(session.home)
        key, whole = retention_key(session), prefix_tokens(session)
        rows = []
        for w in sorted(workers):
            held = self._retention.retained(w).get(key) if self._retention is not None else None
            on_gpu, on_host = gpu.get(w, 0), host.get(w, 0)
            rows.append(
                WorkerKv(
                    worker=w,
                    gpu=on_gpu,
                    held=min(held.tokens, on_gpu) if held is not None else 0,
                    held_until=held.until_s if held is not None else None,
                    host=on_host,
                    gone=max(0, whole - max(on_gpu, on_host)),
                )
            )
        decision, reason = self._decision(session)
        return SessionKvNow(rows, decision, reason)

    def _decision(self, session: SessionState) -> tuple[str | None, str]:
        releases = self.releases
        if releases is not None and releases.in_effect(session) is not None:
            return RELEASED, RELEASE_REASON
        if self._reaper is None:
            return None, REAPER_OFF_REASON
        decided = self._reaper.decision_of(session)
        if decided is None:
            return None, undecided_reason(session)
        return decided.action.value, decided.reason


def undecided_reason(session: SessionState) -> str:
    """Why the idle reaper has no decision on the session: a turn is in flight, its prompt
    is under one block (it never will have one), or none has ended yet."""
    if session.in_flight:
        return IN_FLIGHT_REASON
    chain = session.chain
    if chain is not None and not prefix_tokens(session):
        return f"{UNDER_ONE_BLOCK} ({len(session.token_ids):,} of {chain.block_size} tokens)"
    return NO_DECISION_REASON
