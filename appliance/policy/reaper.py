"""The idle reaper: where a waiting session's KV lives until its next turn, by what each
place costs, and which held KV gives way first.

Model of the world (see `appliance.policy.residency` for the actions): a session idle for
`a` seconds comes back within the `h` seconds left of the maximum residency with
probability P, and a hold would last E[W] = E[min(remaining wait, h)] (both from the
survival model of tool waits, `appliance.policy.survival`, per tenant, tool class and
session depth, with the client's hint as far as its record earns). Per idle period, in
seconds of prefill:

    C_hold    = v_hbm  x M x E[W]                      keep it in HBM
    C_demote  = v_host x M x E[W] + P x promote_s      copy it to the host tier
    C_release = P x re-prefill_s                       give it up (RELEASE, or EVICT)

M is its KV bytes; re-prefill and promotion are at the worker's measured prefill speed and
copy bandwidth, times `second_value` (the value of a second of prefill in the unit of the
tier values). v_tier, the cost of a byte-second of a tier now, is 0 while the tier has room
(usage under `pressure_from`) and rises linearly to the tier's value at full usage: the
value of what a hold would push out, in seconds saved per byte-second (the caller's
`hbm_value`, e.g. the lowest `priority` among the worker's holds; by default that of a
session like this one sure to be back within `displaced_wait_s`). The host tier is an LRU
cache of what the GPU computes (vLLM's offloading stores every block), full once warm: at
`turnover` times the GPU pool's size it keeps a block that many times longer, so by default
what a demotion displaces there is sure to be back within `turnover x displaced_wait_s`.
Valued as HBM is, a full host tier made C_demote = C_hold + P x promote_s: no demotion,
ever, once the tier was warm.

The cheapest allowed action wins, against the standing one (the last decision of this idle
period, RELEASE for a new one) only by a margin (`hysteresis` of the standing cost and at
least `min_gain_s`), so a session does not flap between tiers and a hold must be worth a
minimum. Overriding that: a last step (the turn ended without a tool call) and a session
unlikely to be back (P <= `p_gone`) are EVICTed, as is one past `max_residency_s` (an
abandoned session cannot pin capacity); a hold that would take the tenant's held bytes
past `tenant_cap_bytes` is not allowed, nor a demotion without a host tier or its room.
A turn with no signal at all (how it ended unknown, no tool class, no hint) on a worker with
a host tier is RELEASEd: there a release costs at most a copy back, and the waits learned
per tenant and depth alone do not order sessions better than the engine's LRU (the Mooncake
conversation trace, which carries no tool marks: TTFT p95 1.92 s held against 1.91 s
released, docs/benchmarks.md); without a host tier they do, and the reaper weighs them.

A HOLD lapses at the next revisit, when its idle time has doubled (`REVISIT_GROWTH`, at
least `MIN_REVISIT_S` later, at most the maximum residency): the hazard of a wait changes
as it goes on, and the pool's pressure with it. The caller decides again then (or sooner,
when the pool's pressure changes) to extend, demote or drop it; a caller that never does
gets short holds, then vLLM's LRU.

The eviction order, `priority`: value density, P x saved / (M x E[W]), the expected seconds
saved per byte per second of holding, lowest given back first: Belady's rule (evict what is
needed furthest in the future) with predicted next use, weighted by what a return saves.

Pure: no clock (times are arguments), no I/O, no randomness. State: the wait model only; the
standing decision of a session is its caller's (`IdleSession.standing`, `HeldSession.idle`:
`appliance.services.residency.residency_driver` keeps it for the replay and the live box).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from appliance.policy.residency import (
    HeldSession,
    IdleSession,
    ResidencyAction,
    ResidencyDecision,
    ResidencyFigures,
    ResidencyKind,
)
from appliance.policy.survival import Outlook, WaitKey, WaitSurvival, depth_of
from appliance.policy.wait_curves import MIN_GAP_S, LogNormal

DEFAULT_MAX_RESIDENCY_S = 1800.0
"""No hold past 30 minutes idle: covers the Mooncake conversation trace's p99 gap (1,471 s)
and the workload config's longest test run (1,800 s); the human class's p95 is 900 s."""
DEFAULT_SECOND_VALUE = 1.0
"""A second of re-prefill or promotion costs one second of prefill: the unit of the tier
values. Raise it to weigh the agent's added wait above the space a hold takes."""
DEFAULT_DISPLACED_WAIT_S = 10.0
"""Judgement: HBM at full pressure is worth what it saves a session like the one weighed,
sure to be back within 10 s (so a full pool holds when P x 10 s > E[W]: file, API and search
waits, not tests or people). A few seconds is how fast a busy pool turns over."""
DEFAULT_PRESSURE_FROM = 0.8
"""Judgement: under 80% usage a tier has room, and a hold costs nothing: the rest absorbs
running requests' growth and a new 30k-token prompt (about 3% of an H200's KV pool)."""
DEFAULT_HYSTERESIS = 0.25
"""Judgement: a change must cut the standing cost by a quarter, above the +-0.03..0.1 error
of the wait estimates and the jitter of usage readings."""
DEFAULT_MIN_GAIN_S = 0.005
"""Judgement: a change must save 5 ms of prefill (about 150 tokens on the bundled H200
profile): less is under the router's own overhead per turn."""
DEFAULT_P_GONE = 0.02
"""Judgement: a session with at most a 2% chance of being back in time is not coming back."""
DEFAULT_KV_BYTES_PER_TOKEN = 131_072
"""Llama-3-8B in bf16 (the bundled profile, `appliance/data/h200-llama3-8b-shape.json`)."""
DEFAULT_PREFILL_TOKENS_PER_S = 30_000.0
"""The bundled profile prefills 8,192 tokens in 0.26 s (31k/s) and 32,768 in 1.40 s (23k/s)."""
DEFAULT_COPY_BYTES_PER_S = 50e9
"""The bundled profile copies host to device at 53-55 GB/s (64 MiB and 1 GiB copies)."""
MIN_REVISIT_S = 1.0
REVISIT_GROWTH = 2.0
"""A hold is reconsidered each time its idle time doubles (from 1 s: 12 times in 30 min);
the survival model's bins are 1.33x wide, so its answers move little in between."""


class WaitModel(Protocol):
    """What the reaper asks of a survival model of waits (`WaitSurvival`)."""

    def observe_gap(self, key: WaitKey, gap_s: float, hint_s: float | None = None) -> None: ...

    def observe_censored(self, key: WaitKey, idle_s: float) -> None: ...

    def outlook(
        self, key: WaitKey, idle_s: float, horizon_s: float, hint_s: float | None = None
    ) -> Outlook: ...


def value_density(p_return: float, expected_wait_s: float, saved_s: float, kv_bytes: int) -> float:
    """Expected seconds saved per byte per second of holding: P x saved / (bytes x E[W])."""
    return p_return * saved_s / (max(kv_bytes, 1) * max(expected_wait_s, MIN_GAP_S))


_SAYS = {
    ResidencyKind.NOT_RETURNING: "not coming back in time",
    ResidencyKind.POOL_FREE: "HBM has room",
    ResidencyKind.HOLD_CHEAPEST: "holding is cheapest",
    ResidencyKind.DEMOTE_CHEAPEST: "the host tier is cheapest",
    ResidencyKind.RELEASE_CHEAPEST: "re-prefill is cheapest",
    ResidencyKind.TENANT_CAP: "a hold would pass the tenant's cap",
    ResidencyKind.WITHIN_MARGIN: "a change would gain less than the margin",
}


@dataclass(frozen=True, slots=True)
class _Weighed:
    action: ResidencyAction
    kind: ResidencyKind
    figures: ResidencyFigures


@dataclass(frozen=True, slots=True)
class ReaperTuning:
    """The reaper's settings (see the module and each default's note)."""

    max_residency_s: float = DEFAULT_MAX_RESIDENCY_S
    second_value: float = DEFAULT_SECOND_VALUE
    displaced_wait_s: float = DEFAULT_DISPLACED_WAIT_S
    pressure_from: float = DEFAULT_PRESSURE_FROM
    hysteresis: float = DEFAULT_HYSTERESIS
    min_gain_s: float = DEFAULT_MIN_GAIN_S
    p_gone: float = DEFAULT_P_GONE
    tenant_cap_bytes: int | None = None
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    copy_bytes_per_s: float = DEFAULT_COPY_BYTES_PER_S

    def __post_init__(self) -> None:
        positive = {
            "max_residency_s": self.max_residency_s,
            "second_value": self.second_value,
            "displaced_wait_s": self.displaced_wait_s,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "copy_bytes_per_s": self.copy_bytes_per_s,
        }
        for what, value in positive.items():
            if not 0 < value < float("inf"):
                raise ValueError(f"{what} must be positive and finite, got {value!r}")
        if not (0 <= self.pressure_from < 1 and 0 <= self.hysteresis < 1 and 0 <= self.p_gone < 1):
            raise ValueError("pressure_from, hysteresis and p_gone must be in [0, 1)")
        if not self.min_gain_s >= 0:
            raise ValueError(f"min_gain_s must be >= 0, got {self.min_gain_s!r}")


class Reaper:
    """The idle reaper's residency policy; see the module. `survival`: the wait model
    (default: a `WaitSurvival` from `priors`, tool class -> its wait)."""

    revisits_holds = True
    """A HOLD's `until_s` is when to decide again, not when the hold must end."""

    def __init__(
        self,
        survival: WaitModel | None = None,
        *,
        priors: Mapping[str, LogNormal] | None = None,
        tuning: ReaperTuning | None = None,
        name: str = "reaper",
    ) -> None:
        self.survival: WaitModel = survival if survival is not None else WaitSurvival(priors)
        self.tuning = tuning if tuning is not None else ReaperTuning()
        self.name = name

    def decide(self, session: IdleSession, now: float) -> ResidencyDecision:
        """The decision for a session idle since `finished_at_s`. Asked again about the same
        idle period (the pool as it is now), it revisits the standing decision
        (`session.standing`), which stands unless another is better by the margin."""
        return self._decide(session, max(0.0, now - session.finished_at_s), session.standing)

    def priority(self, held: HeldSession, now: float) -> float:
        """Value density now (`value_density`): the lowest is given back first. A session
        without the idle session it was decided on counts as a new one of the tenant
        `default`."""
        session = held.idle
        if session is None:
            session = IdleSession(held.session_id, held.resident_tokens, held.held_since_s)
        key = _key(session)
        idle_s = max(0.0, now - session.finished_at_s)
        if session.ends_in_tool_call is False or idle_s >= self.tuning.max_residency_s:
            return 0.0
        p, wait_s = self._outlook(session, idle_s, key)
        kv_bytes = self._kv_bytes(session)
        saved_s = self._loss_s(session)
        if session.host is not None and session.host.free_bytes >= kv_bytes:
            saved_s = min(saved_s, self.tuning.second_value * self._promote_s(session, kv_bytes))
        return value_density(p, wait_s, saved_s, kv_bytes)

    def observe_return(self, session: IdleSession, now: float) -> None:
        """The session's next turn arrived at `now`: its gap teaches the wait model."""
        gap_s = max(0.0, now - session.finished_at_s)
        self.survival.observe_gap(_key(session), gap_s, session.expected_wait_s)

    def observe_abandoned(self, session: IdleSession, now: float) -> None:
        """The session ended at `now` without a next turn (closed, timed out, its task
        done or cancelled): it waited at least this long, a censored wait."""
        self.survival.observe_censored(_key(session), max(0.0, now - session.finished_at_s))

    def _decide(
        self, session: IdleSession, idle_s: float, standing: ResidencyAction | None
    ) -> ResidencyDecision:
        if session.ends_in_tool_call is False:
            return ResidencyDecision(
                ResidencyAction.EVICT, "last step: not coming back", kind=ResidencyKind.LAST_STEP
            )
        if idle_s >= self.tuning.max_residency_s:
            return ResidencyDecision(
                ResidencyAction.EVICT,
                f"idle {idle_s:.0f} s: past the {self.tuning.max_residency_s:g} s"
                " maximum residency",
                kind=ResidencyKind.MAX_RESIDENCY,
            )
        if _no_signal(session) and session.host is not None:
            return ResidencyDecision(
                ResidencyAction.RELEASE,
                "no signal of the next turn: the engine's LRU and its host tier keep it",
                kind=ResidencyKind.NO_SIGNAL,
            )
        weighed = self._weigh(session, idle_s, standing)
        until_s = None
        if weighed.action is ResidencyAction.HOLD:
            revisit_s = max(idle_s * REVISIT_GROWTH, idle_s + MIN_REVISIT_S)
            until_s = session.finished_at_s + min(revisit_s, self.tuning.max_residency_s)
        return ResidencyDecision(
            weighed.action,
            _sentence(weighed),
            until_s,
            kind=weighed.kind,
            figures=weighed.figures,
        )

    def _weigh(
        self, session: IdleSession, idle_s: float, standing: ResidencyAction | None
    ) -> _Weighed:
        p, wait_s = self._outlook(session, idle_s, _key(session))
        kv_bytes = self._kv_bytes(session)
        loss_s = self._loss_s(session)
        v_hbm = self._tier_value(session.kv_usage, session.hbm_value, loss_s, kv_bytes)
        c_hold = v_hbm * kv_bytes * wait_s
        c_release = p * loss_s
        costs = {ResidencyAction.RELEASE: c_release}
        cap = self.tuning.tenant_cap_bytes
        capped = cap is not None and session.tenant_held_bytes + kv_bytes > cap
        if not capped:
            costs[ResidencyAction.HOLD] = c_hold
        v_host = c_demote = None
        host = session.host
        if host is not None:
            v_host = self._tier_value(host.usage, host.value, loss_s, kv_bytes, host.turnover)
            promote_s = self._promote_s(session, kv_bytes)
            c_demote = v_host * kv_bytes * wait_s + p * self.tuning.second_value * promote_s
            if host.free_bytes >= kv_bytes:
                costs[ResidencyAction.DEMOTE] = c_demote
        figures = ResidencyFigures(
            p_return=p,
            expected_wait_s=wait_s,
            horizon_s=self.tuning.max_residency_s - idle_s,
            v_hbm=v_hbm,
            c_hold=c_hold,
            c_release=c_release,
            v_host=v_host,
            c_demote=c_demote,
        )
        if p <= self.tuning.p_gone:
            return _Weighed(ResidencyAction.EVICT, ResidencyKind.NOT_RETURNING, figures)
        current = (
            standing if standing is not None and standing in costs else ResidencyAction.RELEASE
        )
        best = min(costs, key=costs.__getitem__)  # ties: release, then hold, then demote
        gain = costs[current] - costs[best]
        margin = max(self.tuning.hysteresis * costs[current], self.tuning.min_gain_s)
        if best is not current and gain <= margin:
            return _Weighed(current, ResidencyKind.WITHIN_MARGIN, figures)
        if capped and c_hold < costs[best]:
            kind = ResidencyKind.TENANT_CAP
        elif best is ResidencyAction.HOLD:
            kind = ResidencyKind.POOL_FREE if v_hbm == 0 else ResidencyKind.HOLD_CHEAPEST
        elif best is ResidencyAction.DEMOTE:
            kind = ResidencyKind.DEMOTE_CHEAPEST
        else:
            kind = ResidencyKind.RELEASE_CHEAPEST
        return _Weighed(best, kind, figures)

    def _outlook(self, session: IdleSession, idle_s: float, key: WaitKey) -> Outlook:
        """(P(back within the residency left), E[wait, truncated there]); `key`: the
        session's (`_key`)."""
        horizon_s = self.tuning.max_residency_s - idle_s
        return self.survival.outlook(key, idle_s, horizon_s, session.expected_wait_s)

    def _tier_value(
        self,
        usage: float,
        value: float | None,
        loss_s: float,
        kv_bytes: int,
        turnover: float = 1.0,
    ) -> float:
        start = self.tuning.pressure_from
        pressure = min(1.0, max(0.0, (usage - start) / (1 - start)))
        if pressure == 0:
            return 0.0
        if value is None:  # a session like this one, sure to be back within displaced_wait_s
            displaced_s = self.tuning.displaced_wait_s * turnover
            value = loss_s / (max(kv_bytes, 1) * displaced_s)
        return pressure * value

    def _kv_bytes(self, session: IdleSession) -> int:
        if session.kv_bytes is not None:
            return session.kv_bytes
        return session.resident_tokens * self.tuning.kv_bytes_per_token

    def _loss_s(self, session: IdleSession) -> float:
        """What a return costs without its KV: the re-prefill, valued."""
        recompute_s = session.recompute_s
        if recompute_s is None:
            recompute_s = session.resident_tokens / self.tuning.prefill_tokens_per_s
        return self.tuning.second_value * recompute_s

    def _promote_s(self, session: IdleSession, kv_bytes: int) -> float:
        if session.promote_s is not None:
            return session.promote_s
        return kv_bytes / self.tuning.copy_bytes_per_s


def _no_signal(session: IdleSession) -> bool:
    """Nothing said how the turn ended or what the session waits on."""
    return (
        session.ends_in_tool_call is None
        and session.tool_class is None
        and session.expected_wait_s is None
    )


def _key(session: IdleSession) -> WaitKey:
    return WaitKey(session.tenant, session.tool_class, depth_of(session.turns))


def _sentence(w: _Weighed) -> str:
    f = w.figures
    demote = "" if f.c_demote is None else f", demote {f.c_demote:.3g}"
    return (
        f"{w.action}: {_SAYS[w.kind]}; P {f.p_return:.2f} back within {f.horizon_s:.0f} s, "
        f"E[W] {f.expected_wait_s:.3g} s; hold {f.c_hold:.3g}{demote}, "
        f"release {f.c_release:.3g} s"
    )
