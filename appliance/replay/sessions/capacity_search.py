"""The capacity search: the most users whose run keeps its TTFT p95 within an SLO.

A run at a count of users (`run(users)`) is a full replay, minutes of wall time, so the
search makes as few as it can. It starts where the box's memory says the answer is
(`first_count`), brackets the answer by steps of `factor` from there (up while runs meet
the SLO, down while they miss), then narrows the bracket to `resolution` of the count
found. On the recorded Claude Code sessions (8 H200s, 256 GiB host each) the first count is
293 with a host tier (the answers: 149 to 199) and 89 without (83): the bracket takes two or
three runs where doubling from 32 took four. A run far above the answer costs little: in one
pass it ends once its p95 is sure to miss (`RunWindow.give_up_over_p95_s`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from appliance.replay.runner import ReplaySetup
from appliance.workload.agent_traces import AgentSessionTrace

SEARCH_FACTOR = 1.25
"""A bracket's step from the first count: fine enough that the bracket leaves a gap of a
quarter, which two or three narrowing runs close to 1/16."""


def first_count(sessions: Sequence[AgentSessionTrace], setup: ReplaySetup, *, host: bool) -> int:
    """Sessions at the median prompt that fit the box's KV: every worker's HBM, and its host
    tier where the stack has one (prompts over the window, skipped by the replay, are left
    out of the median)."""
    window = setup.max_model_len
    fits = sorted(r.input_tokens for s in sessions for r in s.own_requests() if r.fits(window))
    median = fits[len(fits) // 2] if fits else window
    blocks = setup.kv_blocks_per_worker + (setup.host_blocks_per_worker if host else 0)
    return max(1, setup.workers * blocks * setup.block_size // max(median, 1))


def capacity(
    run: Callable[[int], dict[str, object]],
    slo_ttft_p95_s: float,
    *,
    start: int = 32,
    factor: float = 2.0,
    limit: int = 4096,
    resolution: float = 1 / 16,
    confirm_misses: int = 2,
    say: Callable[[str], None] = lambda line: None,
) -> tuple[int, list[dict[str, object]]]:
    """The largest `users` whose run (`run(users)`) keeps its TTFT p95 within the SLO, and
    every run made. From `start`, up by `factor` until `confirm_misses` counts in a row above
    the largest that met it miss it (in a run of fixed duration the p95 of a small count
    rests on a few first turns, so one miss there says little; a pass over every session
    counts them all at any count), or, when `start` misses, down by `factor` until one meets
    it; then narrowing the gap between that largest and the first miss above it until it
    is at most `resolution` of the count found (or 1): each next count where the line
    between the two ends' p95 crosses the SLO, kept a quarter of the gap from either end
    (so the gap shrinks at least by a quarter)."""
    rows: list[dict[str, object]] = []
    p95s: dict[int, float] = {}

    def meets(users: int) -> bool:
        row = run(users)
        rows.append(row)
        p95 = row["ttft_p95_s"]
        ok = isinstance(p95, float | int) and p95 <= slo_ttft_p95_s
        p95s[users] = float(p95) if isinstance(p95, float | int) else math.inf
        cut = f" (sure at {row['gave_up_s']} s: ended there)" if row.get("gave_up_s") else ""
        say(f"{row['stack']}: {users} users: TTFT p95 {p95} s {'meets' if ok else 'misses'}{cut}")
        return ok

    good, bad = _bracket(meets, start, factor, limit, confirm_misses)
    if bad is None:
        return good, rows
    while bad - good > max(1, int(good * resolution)):
        users = _next_count(good, bad, p95s.get(good, 0.0), p95s[bad], slo_ttft_p95_s)
        if meets(users):
            good = users
        else:
            bad = users
    return good, rows


def _bracket(
    meets: Callable[[int], bool], start: int, factor: float, limit: int, confirm_misses: int
) -> tuple[int, int | None]:
    """The largest count found to meet the SLO (0: none) and the first miss above it (None:
    none up to `limit`), stepping by `factor` from `start` (see `capacity`)."""
    users = start
    if not meets(users):
        miss = users
        while users > 1:
            users = min(users - 1, int(users / factor))
            if meets(users):
                return users, miss
            miss = users
        return 0, miss
    good, misses = users, []
    while len(misses) < confirm_misses and _up(users, factor) <= limit:
        users = _up(users, factor)
        if meets(users):
            good, misses = users, []
        else:
            misses.append(users)
    return good, (misses[0] if misses else None)


def _up(users: int, factor: float) -> int:
    return max(users + 1, round(users * factor))


def _next_count(good: int, bad: int, p95_good: float, p95_bad: float, slo: float) -> int:
    """Where the line from (good, its p95) to (bad, its p95) meets the SLO, at least a
    quarter of the gap from either end (the middle when the bad end's p95 is unknown)."""
    gap = bad - good
    at = good + gap / 2
    if math.isfinite(p95_bad) and p95_bad > p95_good:
        at = good + gap * (slo - p95_good) / (p95_bad - p95_good)
    at = min(max(at, good + gap / 4), bad - gap / 4)
    return min(max(round(at), good + 1), bad - 1)
