"""Which waiting sessions' prefixes lost blocks on their worker, read from the KV index.

Model of the world: a session's turn ended on its worker; the index hears its prompt's
blocks stored (possibly a moment after the answer) and, later, removed when the worker
evicts them. A session whose prefix the index shows fewer tokens of than it has shown
since its turn ended, and fewer than the prompt's full blocks, lost KV. With thousands of
sessions waiting, a lookup of each one's chain every watch would cost milliseconds of the
event loop; so a session whose whole prefix the index has shown is looked up again only
after its worker's `KvLookup.losses` count moved.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from appliance.domain.kv_events import Medium
from appliance.domain.records import TaskId, WorkerId
from appliance.policy.residency import IdleSession, ResidencyAction, ResidencyDecision
from appliance.ports import KvLookup
from appliance.services.residency.residency_driver import StandingDecision
from appliance.services.residency.residency_inputs import prefix_tokens, resident_tokens
from appliance.services.residency.tool_waits import UNKNOWN, TurnWait
from appliance.services.sessions.sessions import SessionState


@dataclass(slots=True)
class WaitingSession:
    """A session between its turns, as the reaper loop follows it."""

    session: SessionState
    worker: WorkerId
    standing: StandingDecision
    """Its standing decision and the policy's view it was taken on: the residency driver's
    record itself (`residency_driver.py`), which the loop keeps watching after the driver
    lets it go (an idle period ended unreturned, its KV not yet gone)."""
    due_s: float
    """When to decide again: a hold's revisit, else the maximum residency; inf: never."""
    seen_tokens: int = 0
    """Most of its prefix the KV index has shown on its worker since its turn ended."""
    ended_by: str | None = None
    """What ended its hold other than the reaper: a give-back's reason, or an operator."""
    evicted: bool = False
    wait: TurnWait = UNKNOWN
    """What it waits on (the tools its last answer called, a person), as its turn ended."""

    def ended_why(self, task_closed: Callable[[TaskId], bool]) -> str | None:
        """Why it will not come back for its KV, if it will not: its task closed, or its
        next prompt overflowed the window (its harness compacts). None: it may."""
        task, overflowed_at = self.session.task_id, self.session.overflowed_at
        if self.due_s == math.inf:  # no longer followed for its return
            return None
        if task is not None and task_closed(task):
            return "its task closed"
        if overflowed_at is not None and overflowed_at >= self.idle.finished_at_s:
            return "its next prompt overflowed the window"
        return None

    def kv_left(self, host_tier: bool) -> bool:
        """Some of its KV may still be on its worker: not seen evicted from the GPU, or its
        copies in the worker's `host_tier` (which outlive the GPU's)."""
        return not self.evicted or host_tier

    @property
    def idle(self) -> IdleSession:
        """The policy's view at its last decision."""
        return self.standing.idle

    @idle.setter
    def idle(self, idle: IdleSession) -> None:
        self.standing.idle = idle

    @property
    def decision(self) -> ResidencyDecision:
        return self.standing.decision

    @decision.setter
    def decision(self, decision: ResidencyDecision) -> None:
        self.standing.decision = decision


class PrefixWatch:
    def __init__(self, index: KvLookup) -> None:
        self._index = index
        self._losses_seen: dict[WorkerId, int] = {}
        """Each worker's `losses` count at the last scan."""

    def shrunk(self, waiting: Iterable[tuple[str, WaitingSession]]) -> list[tuple[str, int]]:
        """(key, tokens left) of each session not yet known evicted whose prefix lost
        blocks; raises each one's `seen_tokens` to what the index shows now."""
        counts: dict[WorkerId, int] = {}

        def lost(worker: WorkerId) -> bool:
            if worker not in counts:  # read before the lookups: a loss after it shows next time
                counts[worker] = self._index.losses(worker)
            return counts[worker] != self._losses_seen.get(worker)

        out = []
        for key, w in waiting:
            if w.evicted or (not lost(w.worker) and w.seen_tokens >= prefix_tokens(w.session)):
                continue
            # A demoted session's host copy is what is watched.
            demoted = w.decision.action is ResidencyAction.DEMOTE
            medium = Medium.CPU if demoted else Medium.GPU
            n = resident_tokens(self._index, w.session, w.worker, medium)
            if n >= w.seen_tokens:
                w.seen_tokens = n
            elif n < prefix_tokens(w.session):
                out.append((key, n))
        self._losses_seen.update(counts)
        return out
