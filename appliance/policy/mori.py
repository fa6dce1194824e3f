"""MORI, an anchor: agent programs ranked by idleness, the busiest kept in HBM, the idlest
demoted to host memory, admission per tier.

Source: Xia, Li, Li, Chen, Kang, Qiao, Xu, Stoica, "Idleness is Relative: Exploiting
Tool-Call Idle Windows for Offloading in Agentic Systems with MORI", arXiv:2606.00866
(https://arxiv.org/html/2606.00866; abstract only was readable here), and a reading of it
(https://haiqwa.github.io/en/posts/mori-idleness-is-relative/). Confirmed there: MORI
"ranks all active programs by idleness, assigns the busiest to GPU HBM and the most idle to
CPU DRAM, dynamically shifts the partition boundary to match hardware capacity, and
enforces admission control at each memory tier"; a program's idleness is a score in [0, 1],
the share of its time spent waiting for tool calls. Not confirmed (the paper's body was
not available), so chosen as its authors most plausibly would, here:

- Idleness: tool-wait seconds over the program's lifetime, the wait under way included, so
  a waiting program's rank sinks as its wait goes on. Busy time is a turn's arrival (the
  caller's `observe_return`) to its end; a first turn's, which the policy never sees
  arrive, is the mean of the turns it has seen (the first turn's prefill before any).
- The boundary and HBM admission: while HBM has room (usage under `pressure_from`) every
  active program is held; past it a program is held only if it is no idler than the idlest
  other hold on its worker (`IdleSession.hbm_value`: the lowest `priority` among the
  worker's other holds, as the replay passes it, so minus that program's idleness); a
  program idler than all of them is demoted. A hold is revisited each time its idle time
  doubles (from 1 s), and under pressure the idlest hold then moves down, so the boundary
  follows the pool. Under pressure the mechanism gives holds back in `priority` order, the
  idlest first.
- DRAM admission: a demotion needs the host tier to have room for the program; the tier
  evicts the idlest first (`host_priority`), programs no longer active before any. With no
  host tier, or no room there, the idlest is released instead.
- A turn that did not end in a tool call ends the program: released as vLLM frees a finished
  request (no tier is kept for it). No maximum residency: an abandoned program's idleness
  tends to 1, so it goes first from either tier.

Kinds are the fixed set's nearest (`pool_free`, `hold_cheapest`, `demote_cheapest`,
`release_cheapest`, `last_step`): no cost is weighed; the reason states the ranks.

Pure: no clock (times are arguments), no I/O. State: each active program's times (at most
`MAX_PROGRAMS`, least recently decided dropped).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from appliance.policy.residency import (
    HeldSession,
    IdleSession,
    ResidencyAction,
    ResidencyDecision,
    ResidencyKind,
)

MORI_PRESSURE_FROM = 0.8
"""Judgement, the same headroom as the reaper's: HBM counts as full from 80% usage (the rest
absorbs running requests' growth and a new prompt), where admission by rank begins."""
MORI_MIN_REVISIT_S = 1.0
MORI_REVISIT_GROWTH = 2.0
"""A hold is ranked again each time its idle time doubles, from 1 s: idleness moves fast early
in a wait and slowly later, and re-placing KV on every call is what MORI avoids."""
MAX_PROGRAMS = 65_536
NOT_ACTIVE = -2.0
"""`host_priority` of a program MORI no longer ranks: below any active one (-1..0)."""


@dataclass(frozen=True, slots=True)
class MoriTuning:
    pressure_from: float = MORI_PRESSURE_FROM

    def __post_init__(self) -> None:
        if not 0 <= self.pressure_from <= 1:
            raise ValueError(f"pressure_from must be in [0, 1], got {self.pressure_from!r}")


@dataclass(slots=True)
class _MoriProgram:
    start_s: float
    """Its first turn's arrival (estimated)."""
    finished_at_s: float
    """The end of its latest turn: its current wait began then."""
    waited_s: float = 0.0
    """Tool waits before the current one."""
    returned_at_s: float | None = None
    """Its next turn's arrival, once reported: the current wait has ended."""


class Mori:
    """MORI's residency policy; see the module."""

    revisits_holds = True
    """A HOLD's `until_s` is when to rank it again, not when the hold must end."""

    def __init__(self, tuning: MoriTuning | None = None, *, name: str = "mori") -> None:
        self.tuning = tuning if tuning is not None else MoriTuning()
        self.name = name
        self._programs: OrderedDict[str, _MoriProgram] = OrderedDict()
        self._busy_s = 0.0
        self._busy_turns = 0

    def idleness(self, session_id: str, now: float) -> float | None:
        """Share of the program's life so far spent waiting on tools, 0..1; None: not active."""
        p = self._programs.get(session_id)
        if p is None:
            return None
        end = p.returned_at_s if p.returned_at_s is not None else now
        waited = p.waited_s + max(0.0, end - p.finished_at_s)
        elapsed = now - p.start_s
        return min(1.0, waited / elapsed) if elapsed > 0 else 0.0

    def decide(self, session: IdleSession, now: float) -> ResidencyDecision:
        sid = session.session_id
        if session.ends_in_tool_call is False:
            self._programs.pop(sid, None)
            return ResidencyDecision(
                ResidencyAction.RELEASE,
                "last step: the program is done",
                kind=ResidencyKind.LAST_STEP,
            )
        self._record_turn(session)
        x = self.idleness(sid, now)
        assert x is not None
        return self._place(session, x, now)

    def priority(self, held: HeldSession, now: float) -> float:
        """Minus the idleness: the idlest hold is given back first."""
        x = self.idleness(held.session_id, now)
        return -1.0 if x is None else -x

    def host_priority(self, held: HeldSession, now: float) -> float:
        """The host tier's eviction order: the idlest program first, after those no longer
        active (those least recently used first)."""
        x = self.idleness(held.session_id, now)
        if x is None:
            age_s = max(0.0, now - held.held_since_s)
            # The host tier only sorts by it: any rising squash of the age keeps the order.
            return NOT_ACTIVE - age_s / (1.0 + age_s)  # pragma: no mutate (equivalent: order only)
        return -x

    def observe_return(self, session: IdleSession, now: float) -> None:
        """The program's next turn arrived: its wait ended, its busy time begins."""
        p = self._programs.get(session.session_id)
        if p is not None and p.returned_at_s is None:
            p.returned_at_s = max(now, p.finished_at_s)

    def observe_abandoned(self, session: IdleSession, now: float) -> None:
        """The program ended without a next turn: no longer ranked."""
        self._programs.pop(session.session_id, None)

    def _record_turn(self, session: IdleSession) -> None:
        """Add the turn that just ended to its program's times (nothing on a revisit)."""
        sid, end = session.session_id, session.finished_at_s
        p = self._programs.get(sid)
        if p is None:
            first_busy_s = self._busy_s / self._busy_turns if self._busy_turns else None
            if first_busy_s is None:
                first_busy_s = session.recompute_s or 0.0
            self._programs[sid] = _MoriProgram(end - first_busy_s, end)
            if len(self._programs) > MAX_PROGRAMS:
                self._programs.popitem(last=False)  # pragma: no mutate (equivalent: None is false)
            return
        self._programs.move_to_end(sid)
        if end == p.finished_at_s:
            return
        if p.returned_at_s is not None:
            p.waited_s += p.returned_at_s - p.finished_at_s
            self._busy_s += max(0.0, end - p.returned_at_s)
            self._busy_turns += 1
        else:  # no return reported: the gap less a mean turn was the wait
            mean_busy_s = self._busy_s / self._busy_turns if self._busy_turns else 0.0
            p.waited_s += max(0.0, end - p.finished_at_s - mean_busy_s)
        p.finished_at_s, p.returned_at_s = end, None

    def _place(self, session: IdleSession, x: float, now: float) -> ResidencyDecision:
        idle_s = max(0.0, now - session.finished_at_s)
        until_s = session.finished_at_s + max(
            idle_s * MORI_REVISIT_GROWTH, idle_s + MORI_MIN_REVISIT_S
        )
        if session.kv_usage < self.tuning.pressure_from:
            return ResidencyDecision(
                ResidencyAction.HOLD,
                f"HBM has room: held, idleness {x:.2f}",
                until_s,
                kind=ResidencyKind.POOL_FREE,
            )
        idlest = session.hbm_value  # minus the idleness of the idlest other hold
        if idlest is None or -x >= idlest:
            than = "no other hold" if idlest is None else f"the idlest hold's {-idlest:.2f}"
            return ResidencyDecision(
                ResidencyAction.HOLD,
                f"HBM full: idleness {x:.2f} ranks in HBM ({than})",
                until_s,
                kind=ResidencyKind.HOLD_CHEAPEST,
            )
        host = session.host
        below = f"idleness {x:.2f} is past the idlest hold's {-idlest:.2f}"
        if host is not None and (session.kv_bytes is None or host.free_bytes >= session.kv_bytes):
            return ResidencyDecision(
                ResidencyAction.DEMOTE,
                f"HBM full: {below}: to host memory",
                kind=ResidencyKind.DEMOTE_CHEAPEST,
            )
        where = "no host tier" if host is None else "no room in host memory"
        return ResidencyDecision(
            ResidencyAction.RELEASE,
            f"HBM full: {below}, {where}: released",
            kind=ResidencyKind.RELEASE_CHEAPEST,
        )
