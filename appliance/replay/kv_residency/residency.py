"""A residency policy (`appliance.policy.residency`) driving the simulated engines' pins.

Model of the world: the engine asks once per finished request whether to hold its blocks
(`SimEngine(residency=...)`), and ranks standing pins when it must give some back early.
This adapter builds the policy's inputs from what the engine and the workload know: the
request's session, its cached tokens, the worker's KV usage, the seconds a prefill of those
tokens would take (the latency model), and, when the workload says so (`TurnHint`), whether
the turn ended in a tool call and how long the tool is expected to take. A trace carries
no hints, so a policy sees "unknown" there. HOLD becomes a pin until `until_s`; RELEASE
leaves the blocks to vLLM's LRU; DEMOTE copies them to the worker's host tier and frees
them on the GPU (the engine refuses it when the worker has no host tier: `--host-gib`);
EVICT frees them to the head of the GPU's eviction order. Decisions are counted by reason
(`reasons`), by kind (`kinds`), by action (`actions`), and by tool class and action
(`by_tool`).

The policy is driven by the residency driver the live box drives it with
(`appliance.services.residency.residency_driver`): it keeps each session's standing decision
and tells a policy that learns from its sessions (the reaper: `observe_return`,
`observe_abandoned`) of each idle period's end exactly once: its session's next turn
arriving at an engine (`turn_arrived`), or the session ending without one: the workload's
task ending (`TurnHint.session_ends`: at the turn's end plus its tool wait, when the client
gives up), or an idle time past the policy's `tuning.max_residency_s` (a session timed
out). A policy that revisits its holds (`revisits_holds`) is asked again about each pin as
it comes due, with the worker as it is then, and the engine extends, demotes, evicts or
lets it lapse as it says. The host tier is a cache that makes room by evicting, so a
session's room there is its capacity and its pressure the share in use.

Two optional companions: a `watch` told of every turn end (with the idle session as the
policy saw it and the hint) and every arrival, which may rank a pin above the policy's
priority (restore on lead time, `prefetch.py`: a prefetched session keeps the value it was
restored for until its turn), and a `bound` that may overrule a decision (a branch's quota,
`branches.py`).

Host-tier eviction order: the host tier is LRU, as vLLM's, unless the policy has a
`host_priority(held: HeldSession, now) -> float` method, which then ranks the sessions
whose blocks the host tier holds, the lowest evicted first (`resident_tokens` their host
blocks, `held_since_s` their last use, `until_s` infinite).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from appliance.domain.retention import HostTierSize
from appliance.perf.latency import CopyDirection, LatencyModel
from appliance.policy.residency import (
    DEFAULT_TENANT,
    HostTierReading,
    IdleSession,
    ResidencyAction,
    ResidencyPolicy,
)
from appliance.policy.residency_by_name import residency_policy
from appliance.policy.wait_curves import LogNormal
from appliance.services.residency.residency_driver import DecisionBound, ResidencyDriver
from appliance.sim.engine_io import SimRequest
from appliance.sim.kv.host_tier import HostPriority, HostSession
from appliance.sim.kv.pins import Pin
from appliance.sim.kv.residency_hook import AfterTurn, PinDue, TurnEnd


@dataclass(frozen=True, slots=True)
class TurnHint:
    """What the client said about a turn (`X-Tool-Class`, `X-Expected-Tool-Wait-S`), and
    whether its session ends after it (`session_ends`: no next turn; with a tool call, the
    client gives up after `expected_wait_s`)."""

    ends_in_tool_call: bool | None
    """None: the client's answer did not say."""
    tool_class: str | None = None
    expected_wait_s: float | None = None
    session_ends: bool = False


Hints = Callable[[str], TurnHint | None]
"""Request id -> its hint, if the workload has one."""


class ResidencyWatch(Protocol):
    """Told of each turn end (the session as the policy sees it) and each arrival; may rank
    a held session higher than the policy does (`held_value`: a session whose KV it
    restored for a turn about to come, at the value it restored it for)."""

    def turn_ended(self, end: TurnEnd, hint: TurnHint | None, session: IdleSession) -> None: ...

    def turn_arrived(self, req: SimRequest, now: float) -> None: ...

    def held_value(self, session_id: str) -> float | None: ...


class WaitDistribution(Protocol):
    @property
    def median(self) -> float: ...
    @property
    def p95(self) -> float: ...


def wait_priors(tool_classes: Mapping[str, WaitDistribution]) -> dict[str, LogNormal]:
    """Tool class -> its wait as a prior for the reaper (a workload spec's `tool_classes`)."""
    return {name: LogNormal.from_median_p95(d.median, d.p95) for name, d in tool_classes.items()}


class PolicyResidency:
    """The engines' residency hook (`appliance.sim.kv.residency_hook.ResidencyHook`) for one
    policy, driven as the live box drives it (`ResidencyDriver`)."""

    def __init__(
        self,
        policy: ResidencyPolicy | str,
        *,
        latency: LatencyModel,
        block_size: int,
        hints: Hints | None = None,
        watch: ResidencyWatch | None = None,
        bound: DecisionBound | None = None,
    ) -> None:
        policy = residency_policy(policy) if isinstance(policy, str) else policy
        self.driver = ResidencyDriver(policy, bound=bound)
        self.latency = latency
        self.block_size = block_size
        self.hints = hints
        self.watch = watch
        self.reasons = self.driver.reasons
        self.actions = self.driver.actions
        self.kinds = self.driver.kinds
        self.by_tool = self.driver.by_tool
        self._turns: Counter[str] = Counter()
        """Session -> turns finished so far: the reaper learns waits per session depth."""
        self._ends: list[tuple[float, str, float]] = []  # (at_s, session, finished_at_s)
        self._ranks: dict[tuple[str, int], float] = {}  # pin -> priority, at `_ranks_at`
        self._ranks_at = -math.inf

    @property
    def policy(self) -> ResidencyPolicy:
        return self.driver.policy

    @property
    def name(self) -> str:
        return self.driver.policy.name

    @property
    def host_priority(self) -> HostPriority | None:
        """The policy's order for the host tier, if it has one (else the tier is LRU)."""
        driver = self.driver
        if not driver.host_ranked:
            return None
        bs = self.block_size

        def priority(s: HostSession, now: float) -> float:
            owner = s.owner if s.owner is not None else ""
            held = driver.held(owner, s.num_blocks * bs, s.last_used_s, math.inf)
            return driver.host_priority(held, now)

        return priority

    def after_turn(self, end: TurnEnd) -> AfterTurn:
        self._report_ends(end.now_s)
        req = end.request
        self._turns[_session_id(req)] += 1
        hint = self.hints(req.request_id) if self.hints is not None else None
        session = self._idle_session(req, hint, end)
        self._schedule_end(session, hint)
        if self.watch is not None:
            self.watch.turn_ended(end, hint, session)
        return self._decide(session, end.now_s)

    def revisit(self, due: PinDue) -> AfterTurn:
        """A held session's pin is due: decide again for the same idle period, the worker
        as it is now (a session already back, or ended, lets its pin lapse)."""
        self._report_ends(due.now_s)
        standing = self.driver.standing(due.pin.owner)
        if (
            not self.driver.revisits
            or standing is None
            or standing.idle.finished_at_s != due.pin.pinned_at_s
        ):
            return AfterTurn("release")
        session = standing.idle
        now_session = dataclasses.replace(
            session,
            kv_usage=due.kv_usage,
            host=self._host(session.kv_bytes or 0, due.host),
            tenant_held_bytes=self._tenant_held_bytes(session, due.pins),
            hbm_value=self._hbm_value(session.session_id, due.kv_usage, due.pins, due.now_s),
        )
        return self._decide(now_session, due.now_s)

    def turn_arrived(self, req: SimRequest, now: float) -> None:
        """A request arrived: its session's idle period, if any, ends in a return."""
        self._report_ends(now)
        if self.watch is not None:
            self.watch.turn_arrived(req, now)
        if self.driver.returned(_session_id(req), now):
            self._ranks.clear()

    def pin_priority(self, pin: Pin, now: float) -> float:
        """The policy's priority of a held session, asked once per pin and instant (the
        engine ranks the same pins for every allocation and turn end of a step) until the
        policy learns something (a decision on that session, a return, an abandonment)."""
        if now != self._ranks_at:
            self._ranks.clear()
            self._ranks_at = now
        key = (pin.owner, pin.seq)
        rank = self._ranks.get(key)
        if rank is None:
            bs = self.block_size
            held = self.driver.held(pin.owner, pin.num_blocks * bs, pin.pinned_at_s, pin.until_s)
            rank = self.driver.priority(held, now)
            if self.watch is not None and (value := self.watch.held_value(pin.owner)):
                rank = max(rank, value)  # a prefetched session, about to be back
            self._ranks[key] = rank
        return rank

    def _decide(self, session: IdleSession, now: float) -> AfterTurn:
        decision = self.driver.decide(session, now).decision
        for key in [k for k in self._ranks if k[0] == session.session_id]:
            del self._ranks[key]
        if decision.action is ResidencyAction.HOLD:
            return AfterTurn("hold", decision.until_s)
        if decision.action is ResidencyAction.DEMOTE:
            return AfterTurn("demote")
        if decision.action is ResidencyAction.EVICT:
            return AfterTurn("evict")
        return AfterTurn("release")

    def _idle_session(self, req: SimRequest, hint: TurnHint | None, end: TurnEnd) -> IdleSession:
        n = end.resident_tokens
        kv_bytes = self.latency.kv_bytes(n)
        session = IdleSession(
            session_id=_session_id(req),
            resident_tokens=n,
            finished_at_s=end.now_s,
            ends_in_tool_call=hint.ends_in_tool_call if hint else None,
            tool_class=hint.tool_class if hint else None,
            turns=self._turns[_session_id(req)],
            expected_wait_s=hint.expected_wait_s if hint else None,
            recompute_s=self.latency.prefill_s(n) if n else 0.0,
            kv_usage=end.kv_usage,
            kv_bytes=kv_bytes,
            host=self._host(kv_bytes, end.host),
            promote_s=self.latency.kv_copy_s(n, CopyDirection.H2D) if n else 0.0,
            tenant=req.cache_salt or DEFAULT_TENANT,
        )
        return dataclasses.replace(
            session,
            tenant_held_bytes=self._tenant_held_bytes(session, end.pins),
            hbm_value=self._hbm_value(session.session_id, end.kv_usage, end.pins, end.now_s),
        )

    def _hbm_value(
        self, session_id: str, kv_usage: float, pins: tuple[Pin, ...], now: float
    ) -> float | None:
        """The lowest priority among the worker's other holds (`ResidencyDriver.hbm_value`)."""
        return self.driver.hbm_value(
            kv_usage, lambda: (self.pin_priority(p, now) for p in pins if p.owner != session_id)
        )

    def _tenant_held_bytes(self, session: IdleSession, pins: tuple[Pin, ...]) -> int:
        """Bytes the session's tenant holds on this worker, its own pin not counted."""
        bs, kv_bytes = self.block_size, self.latency.kv_bytes
        return self.driver.tenant_held_bytes(
            session, lambda: ((p.owner, kv_bytes(p.num_blocks * bs)) for p in pins)
        )

    def _host(self, kv_bytes: int, tier: HostTierSize | None) -> HostTierReading | None:
        """The host tier as the policy sees it: room for the whole session (it is a cache
        that evicts to make room) while the session fits in it; None without one."""
        if tier is None or not tier.blocks:
            return None
        capacity_bytes = self.latency.kv_bytes(tier.blocks * self.block_size)
        usage = tier.used_blocks / tier.blocks
        return HostTierReading(capacity_bytes, usage, turnover=tier.turnover)

    def _schedule_end(self, session: IdleSession, hint: TurnHint | None) -> None:
        """When the idle period ends without a return: the task's end, or the time-out."""
        if hint is not None and hint.session_ends:
            at_s = session.finished_at_s + (hint.expected_wait_s or 0.0)
        elif self.driver.max_idle_s is not None:
            at_s = session.finished_at_s + self.driver.max_idle_s
        else:
            return
        heapq.heappush(self._ends, (at_s, session.session_id, session.finished_at_s))

    def _report_ends(self, now: float) -> None:
        """Tell the policy of the idle periods that ended by `now` without a return."""
        ends = self._ends
        while ends and ends[0][0] <= now:
            at_s, sid, finished_at_s = heapq.heappop(ends)
            standing = self.driver.standing(sid)
            if standing is None or standing.idle.finished_at_s != finished_at_s:
                continue  # it came back, or a later period of it is under way
            self.driver.abandoned(sid, at_s)
            self._ranks.clear()


def _session_id(req: SimRequest) -> str:
    return req.session_id if req.session_id is not None else req.request_id
