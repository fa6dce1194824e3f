"""The turn desk's one call into escalation: the side of a turn, and serving it there.

A turn whose side is an outside endpoint (policy/escalation.py's rules) skips the local
box's admission and goes there; when that endpoint is at its cap, or its attempt fails
(recorded as a failed attempt), the turn comes back to the local box: through its admission
(which may refuse it, with its reason), then placed and forwarded as any local turn, its
ledger row saying why it came back. A local turn the box's admission refuses may spill over
to `spill_to` instead (`spill`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace

from appliance.domain.errors import EngineError
from appliance.policy.escalation import Side, SideRules, spill_side
from appliance.ports import Clock
from appliance.services.escalation.relay import OutsideRelay
from appliance.services.escalation.sides import TaskSides
from appliance.services.tasks.admission import AdmissionRefused
from appliance.services.turns.turn import Reply, TurnRequest

log = logging.getLogger(__name__)

OUTSIDE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
"""The routes an outside endpoint serves (a Messages API turn is a chat turn by then)."""
LocalTurn = Callable[[TurnRequest, bool], Awaitable[Reply]]
"""The local box's service of a turn: (the turn, whether it still needs admission)."""


class Escalation:
    def __init__(
        self,
        relays: Mapping[str, OutsideRelay],
        rules: SideRules | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.relays = dict(relays)
        self.sides = TaskSides(rules or SideRules(frozenset(self.relays)))
        self._clock = clock

    @property
    def active(self) -> bool:
        return bool(self.relays)

    def side(self, turn: TurnRequest, header: str | None, task_class: str | None) -> Side:
        """Where the turn goes; a header is judged even with no endpoint configured. A
        Responses API turn stays local (its state is stored on the worker that served it)."""
        if (not self.relays and header is None) or turn.path not in OUTSIDE_PATHS:
            return Side(None, "local")
        return self.sides.choose(turn.task_id, header=header, task_class=task_class)

    def spill(
        self, refused: AdmissionRefused, deadline_s: float | None, deadline_at: float | None
    ) -> Side:
        """The outside side a turn the local box refused spills to; raises the refusal where
        it stands (`deadline_s`: the turn's X-Deadline-S; `deadline_at`: its task's)."""
        to = self.sides.rules.spill_to
        relay = self.relays.get(to) if to is not None else None
        if relay is None:
            raise refused
        if deadline_s is None and deadline_at is not None and self._clock is not None:
            deadline_s = deadline_at - self._clock.now()
        side = spill_side(
            refused.code,
            spill_to=to,
            latency_s=relay.link.latency_s,
            room=not relay.full,
            deadline_s=deadline_s,
        )
        if side is None:
            raise refused
        log.info("turn spills over to %s: %s", to, side.reason)
        return side

    async def serve(self, turn: TurnRequest, side: Side, local: LocalTurn) -> Reply:
        """The turn on its side; back on the local box when the outside cannot take it."""
        if side.endpoint is None:
            return await local(turn, False)
        relay = self.relays[side.endpoint]
        if relay.full or not relay.takes(turn.path):
            cap = f"at its cap of {relay.link.max_concurrent} turns"
            why = f"{side.endpoint} {cap if relay.full else 'takes chat turns only'}: local"
            return await local(replace(turn, side_reason=why), True)
        try:
            return await relay.send(turn, side.reason)
        except EngineError as exc:
            log.warning("escalation to %s failed: %s; the turn goes local", side.endpoint, exc)
            why = f"{side.endpoint} failed ({exc.code}): local"
            return await local(replace(turn, side_reason=why), True)

    async def aclose(self) -> None:
        for relay in self.relays.values():
            close = getattr(relay.link.client, "aclose", None)
            if close is not None:
                await close()
