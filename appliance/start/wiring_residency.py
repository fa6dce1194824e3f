"""The residency policy's part of the composition root: `residency.policy` names the policy the
live loop runs (`appliance.policy.residency_by_name`: the reaper by default, or an anchor:
lru, ttl-pin, mori), the reaper with the `residency` settings; and a policy that learns waits
(one with a wait model, `survival`: the reaper) has it warmed from the waits between the
ledger's recent turns, those that ended in a return and those that did not. Beside it, what
the state and the operators see of sessions' KV, and an operator's release of it."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from appliance.api.admin.admin_sessions import SessionAdmin
from appliance.config.settings import ResidencySettings
from appliance.ledger import LedgerWriter
from appliance.ledger.restore import session_gaps
from appliance.ledger.session_history import session_turns
from appliance.policy.reaper import ReaperTuning
from appliance.policy.residency import ResidencyPolicy
from appliance.policy.residency_by_name import residency_policy
from appliance.policy.survival import PERSON, WaitKey
from appliance.policy.wait_curves import LogNormal
from appliance.services.operator.events import EventFeed
from appliance.services.operator.session_admin import SessionReleases
from appliance.services.residency.reaper_loop import ReaperLoop
from appliance.services.residency.session_kv import SessionKv
from appliance.services.turns.turn_desk import TurnDesk
from appliance.workload.spec import WorkloadSpec


def live_residency_policy(
    r: ResidencySettings,
    *,
    kv_bytes_per_token: int,
    ledger_path: Path,
    window: tuple[float, float],
    limit: int,
) -> ResidencyPolicy:
    """The policy `r.policy` names; a wait model's restore reads the ledger's turns in
    `window` (since, now), at most `limit` of them."""
    tuning = ReaperTuning(
        max_residency_s=r.max_residency_s,
        pressure_from=r.pressure_from,
        tenant_cap_bytes=r.tenant_cap_bytes,
        kv_bytes_per_token=kv_bytes_per_token,
    )
    policy = residency_policy(r.policy, priors=_live_wait_priors(), tuning=tuning)
    survival = getattr(policy, "survival", None)
    if survival is None:  # it learns no waits
        return policy
    since, now = window
    for gap in session_gaps(ledger_path, since=since, now=now, limit=limit):
        key = WaitKey(gap.tenant, None, gap.depth)
        if gap.returned:
            survival.observe_gap(key, gap.seconds)
        else:
            survival.observe_censored(key, gap.seconds)
    return policy


def _live_wait_priors() -> dict[str, LogNormal]:
    """The reaper's priors: the workload config's tool classes' waits, and for a person's
    reply (an answer that called no tool) its human wait."""
    priors = {
        name: LogNormal.from_median_p95(c.median, c.p95)
        for name, c in WorkloadSpec().tool_classes.items()
    }
    if "human" in priors:
        priors.setdefault(PERSON, priors["human"])
    return priors


def sessions_kv(
    desk: TurnDesk,
    ledger: LedgerWriter,
    events: EventFeed,
    kv_bytes_per_token: int,
    reaper: ReaperLoop | None,
    ledger_path: Path,
) -> tuple[SessionAdmin, SessionKv]:
    """What the state and the operators see of sessions' KV, and the operators' session
    routes: one session's detail (its turns read from the ledger) and its release."""
    releases = SessionReleases(
        desk.sessions,
        ledger,
        events,
        kv_bytes_per_token,
        kv_release=reaper.release if reaper is not None else None,
    )
    kv = SessionKv(desk.placer.residency, releases, reaper)
    turns = partial(_session_turns, ledger_path)
    return SessionAdmin(releases, turns, kv), kv


def _session_turns(ledger_path: Path, tenant: str, session_id: str, n: int) -> list[dict[str, Any]]:
    return session_turns(ledger_path, tenant, session_id, limit=n)
