"""When a waiting session's next turn becomes likely, by the survival model of waits: the
time restore on lead time's `TOOL_DUE` and `HAZARD` signals fire (`appliance.policy.prefetch`).

Model of the world: a session away for `a` seconds comes back within a window with the
probability the wait model gives (`WaitSurvival.outlook`, with the client's
expected duration weighed by the trust its record earned, or without it). The signal is
due at the first idle time, on the model's bin edges, from which that probability reaches
a threshold: before it a prefetch would wait too long for its turn, held in HBM.

Restore ahead of the predicted return (`RESTORE_AHEAD`, live with `residency.restore_ahead`
and in the agent-session replay's `appliance-restore`) asks the same question, and again:
the session may still be in HBM when its turn first becomes likely (a worker gives a hold
back under pressure at any time), so a signal that restored nothing is due again at the
first bin edge from `recheck_s` later at which the turn is still that likely
(`DueRule.next_s`, `after_s`).

Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from appliance.policy.prefetch import DEFAULT_HOLD_S, DEFAULT_MIN_LEAD_S, PrefetchTrigger
from appliance.policy.residency import IdleSession
from appliance.policy.survival import Outlook, WaitKey, depth_of
from appliance.policy.wait_curves import EDGES

DEFAULT_DUE_WINDOW_S = 5.0
DEFAULT_DUE_THRESHOLD = 0.6
"""Judgement: `TOOL_DUE` and `HAZARD` fire once the turn is more likely than 0.6 to come
within 5 s (a prefetch is held for `DEFAULT_HOLD_S`, and settled unused if it does not)."""
_BIN_RATIO = EDGES[1] / EDGES[0]
RESTORE_RECHECK_S = 1.0
"""Judgement: a session found in HBM at its due time is looked at again a second (a few
bins early in a wait, one bin later on) later at the soonest: its KV leaves HBM only when
another turn needs the room, and a restore's copy takes a few tenths of a second."""


class ReturnModel(Protocol):
    """What is asked of a survival model of waits (`WaitSurvival`, the reaper's)."""

    def outlook(
        self, key: WaitKey, idle_s: float, horizon_s: float, hint_s: float | None = None
    ) -> Outlook: ...


def first_likely_return_s(
    model: ReturnModel,
    key: WaitKey,
    *,
    hint_s: float | None,
    horizon_s: float,
    window_s: float = DEFAULT_DUE_WINDOW_S,
    threshold: float = DEFAULT_DUE_THRESHOLD,
    hold_s: float = DEFAULT_HOLD_S,
    after_s: float = 0.0,
) -> float | None:
    """The first idle time, on the wait model's bin edges from `after_s` and before
    `horizon_s`, from which the turn is back within the window with probability >=
    `threshold` (None: none is). The window is `window_s`, or one bin from there when that
    is wider (the model tells times apart no finer than its bins), but no longer than a
    prefetch is held (`hold_s`). Idle times under `DEFAULT_MIN_LEAD_S` but the turn's end
    are not looked at: nothing restores that fast."""
    late = (e for e in EDGES if e >= DEFAULT_MIN_LEAD_S)  # pragma: no mutate (none equals it)
    for idle_s in (a for a in (0.0, *late) if after_s <= a < horizon_s):
        window = min(hold_s, max(window_s, idle_s * (_BIN_RATIO - 1)))
        if model.outlook(key, idle_s, window, hint_s).p_return >= threshold:
            return idle_s
    return None


@dataclass(frozen=True, slots=True)
class DueRule:
    """When a wait-model signal is due (`first_likely_return_s`'s window and threshold),
    and how soon after one it may be due again (`recheck_s`; None: once a wait)."""

    window_s: float = DEFAULT_DUE_WINDOW_S
    threshold: float = DEFAULT_DUE_THRESHOLD
    recheck_s: float | None = None

    def next_s(
        self,
        model: ReturnModel,
        key: WaitKey,
        *,
        hint_s: float | None,
        horizon_s: float,
        after_s: float | None = None,
    ) -> float | None:
        """The idle time the signal is due at: the first likely one (`after_s` None), or
        the first from `recheck_s` past the one at `after_s` (None: none before the
        horizon, or no recheck)."""
        if after_s is None:
            start = 0.0
        elif self.recheck_s is None:
            return None
        else:
            start = after_s + self.recheck_s
        return first_likely_return_s(
            model,
            key,
            hint_s=hint_s,
            horizon_s=horizon_s,
            window_s=self.window_s,
            threshold=self.threshold,
            after_s=start,
        )


ONCE = DueRule()
"""The wait model's signals as restore on lead time asks for them: once a wait, when the
turn is likely within `DEFAULT_DUE_WINDOW_S`."""
RESTORE_AHEAD = DueRule(recheck_s=RESTORE_RECHECK_S)
"""Restore ahead of the predicted return: due once the turn is likely within the window,
and again a recheck later while it still is. Not the hold as the window: the waits of
recorded agent sessions are broad (docs/benchmarks.md), so a turn likely within 30 s is
likely at once, when the reaper has just demoted the session for a wait it judged long."""


def signal_due_s(
    rule: DueRule,
    model: ReturnModel,
    session: IdleSession,
    trigger: PrefetchTrigger,
    *,
    horizon_s: float,
    after_s: float | None = None,
) -> float | None:
    """The idle time the wait model's `trigger` is due at for a waiting session
    (`rule.next_s`, asked under the reaper's key for it: tenant, tool class, depth): `HAZARD`
    from history alone, `TOOL_DUE` with the client's expected wait (None without one, and
    for an announcement, which the model does not time)."""
    if trigger is PrefetchTrigger.HAZARD:
        hint_s = None
    elif trigger is PrefetchTrigger.TOOL_DUE and session.expected_wait_s is not None:
        hint_s = session.expected_wait_s
    else:
        return None
    key = WaitKey(session.tenant, session.tool_class, depth_of(session.turns))
    return rule.next_s(model, key, hint_s=hint_s, horizon_s=horizon_s, after_s=after_s)
