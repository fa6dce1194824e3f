"""When a waiting session's next turn becomes likely, by the survival model of waits: the
time restore on lead time's `TOOL_DUE` and `HAZARD` signals fire (`appliance.policy.prefetch`).

Model of the world: a session away for `a` seconds comes back within a window with the
probability the wait model gives (`WaitSurvival.p_return_within`, with the client's
expected duration weighed by the trust its record earned, or without it). The signal is
due at the first idle time, on the model's bin edges, from which that probability reaches
a threshold: before it a prefetch would wait too long for its turn, held in HBM.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from typing import Protocol

from appliance.policy.prefetch import DEFAULT_HOLD_S, DEFAULT_MIN_LEAD_S
from appliance.policy.survival import WaitKey
from appliance.policy.wait_curves import EDGES

DEFAULT_DUE_WINDOW_S = 5.0
DEFAULT_DUE_THRESHOLD = 0.6
"""Judgement: `TOOL_DUE` and `HAZARD` fire once the turn is more likely than 0.6 to come
within 5 s (a prefetch is held for `DEFAULT_HOLD_S`, and settled unused if it does not)."""
_BIN_RATIO = EDGES[1] / EDGES[0]


class ReturnModel(Protocol):
    """What is asked of a survival model of waits (`WaitSurvival`)."""

    def p_return_within(
        self, key: WaitKey, idle_s: float, t_s: float, hint_s: float | None = None
    ) -> float: ...


def first_likely_return_s(
    model: ReturnModel,
    key: WaitKey,
    *,
    hint_s: float | None,
    horizon_s: float,
    window_s: float = DEFAULT_DUE_WINDOW_S,
    threshold: float = DEFAULT_DUE_THRESHOLD,
    hold_s: float = DEFAULT_HOLD_S,
) -> float | None:
    """The first idle time, on the wait model's bin edges before `horizon_s`, from which the
    turn is back within the window with probability >= `threshold` (None: none is). The
    window is `window_s`, or one bin from there when that is wider (the model tells times
    apart no finer than its bins), but no longer than a prefetch is held (`hold_s`). Idle
    times under `DEFAULT_MIN_LEAD_S` are not looked at: nothing restores that fast."""
    late = (e for e in EDGES if e >= DEFAULT_MIN_LEAD_S)  # pragma: no mutate (none equals it)
    for idle_s in (a for a in (0.0, *late) if a < horizon_s):
        window = min(hold_s, max(window_s, idle_s * (_BIN_RATIO - 1)))
        if model.p_return_within(key, idle_s, window, hint_s) >= threshold:
            return idle_s
    return None
