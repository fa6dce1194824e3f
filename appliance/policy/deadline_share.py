"""A task's deadline, and a turn's share of it: the time left less the task's expected
remaining work, learned from the finished tasks of its class.

Model of the world. A task with a deadline runs a turn, then its tools (and children, and its
agent's own work), then its next turn, and so on until it closes. A turn allowed all the time
left to the deadline leaves its task none for what must come after it: a turn stuck in a
queue is waited on until the whole task is lost, and its client hears of it when nothing can
be done any more. So a turn's timeout (when it must have its first byte: services/turns/flights.py)
is the deadline less the task's *reserve*, what its class's history says is still to come.

History. A class's history is its tasks that closed `succeeded` (`TaskRun`): the turns each
ran; the seconds its turns were in flight (overlapping turns counted once); the seconds
between its first turn's start and its last turn's end with no turn in flight (tools,
children, the agent's own work); and the seconds from its last turn's end to its close.

Reserve after a task's `k`-th turn (`reserve_after`), once the class has `min_runs` tasks:

    more turns   the mean of (turns - k) over its tasks that ran at least k turns (0 when
                 none ran so many: the task is longer than any seen, likely near its end)
    per turn     the class's in-flight seconds over its turns
    per gap      the class's between-turn seconds over its gaps (turns - 1 per task)
    tail         the class's mean seconds from the last turn's end to the close
    reserve  =   more turns * (per turn + per gap) + tail

A mean, not a high quantile: the reserve is taken from the turn in hand, so a cautious
reserve aborts turns that would have made it. With less history there is no reserve (None):
the turn may use all the time left, as the turn of a task without a class does.

Share (`turn_share`): the turn must have its first byte by the deadline less the reserve, but
never sooner than its own need from now (its estimated first token at the worker placement
chose: that worker's wake, queue and this turn's prefill there), and never after the
deadline. A turn whose need is beyond its share runs into the reserve (`cut`): refusing it
would turn an estimate of the task's future into the task's certain failure; admission
refuses only a turn that cannot meet the deadline itself (`deadline_infeasible`).

Judged worker (`judged_worker`): admission judges whether a turn can meet its deadline at
the worker placement chose for it, from the same estimates placement ranked it by (one
decision: the fastest worker may hold none of the session's prefix, or be the one placement
passed over for its queue); with none chosen (a task with no turn yet, every worker resting
until one wakes) at the fastest.

Pure: no clock, no I/O; the caller passes `now`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIN_RUNS = 3
"""Judgement: finished tasks of a class before its history sets a reserve (one or two are
as likely to mislead as to inform)."""


def effective_deadline(
    now: float, deadline_s: float | None, parent_deadline_at: float | None
) -> float | None:
    """A task's deadline: the earlier of its own (`deadline_s` from `now`) and its
    parent's; None when neither has one."""
    own = now + deadline_s if deadline_s is not None else None
    if own is None or parent_deadline_at is None:
        return own if own is not None else parent_deadline_at
    return min(own, parent_deadline_at)


@dataclass(frozen=True, slots=True)
class WorkerEstimate:
    """One healthy worker that takes new work, as the router estimates it."""

    queue_s: float
    """Seconds of queued prefill ahead of new work there."""
    prefill_s: float = 0.0
    """Seconds to prefill this turn there (what is not resident); 0 for a task alone."""
    wake_s: float = 0.0
    """Seconds until it serves again: a worker asleep or stopped by the worker reaper."""
    worker: str = ""

    @property
    def first_token_s(self) -> float:
        return self.wake_s + self.queue_s + self.prefill_s


def judged_worker(workers: Sequence[WorkerEstimate], placed: str | None) -> WorkerEstimate | None:
    """The worker a turn's deadline is judged on: `placed`, placement's choice, when it is
    one of `workers`; else the fastest to a first token (None: no worker)."""
    chosen = [w for w in workers if w.worker == placed]
    return chosen[0] if chosen else min(workers, key=_first_token, default=None)


def _first_token(w: WorkerEstimate) -> float:
    return w.first_token_s


@dataclass(frozen=True, slots=True)
class TaskRun:
    """One finished task of a class, as its history keeps it."""

    turns: int
    turn_s: float
    """Seconds with a turn of it in flight."""
    between_s: float
    """Seconds between its first turn's start and its last turn's end with none in flight."""
    tail_s: float
    """Seconds from its last turn's end to its close."""


@dataclass(frozen=True, slots=True)
class Reserve:
    """A task's expected remaining work after its current turn (the module docstring)."""

    seconds: float
    more_turns: float
    turn_s: float
    """Per turn."""
    gap_s: float
    """Per gap between two turns."""
    tail_s: float
    runs: int
    """The class's finished tasks it was learned from."""

    def describe(self) -> str:
        return (
            f"about {self.more_turns:.1f} more turns of {self.turn_s:.3f} s with "
            f"{self.gap_s:.3f} s between, then {self.tail_s:.3f} s to close, "
            f"learned from {self.runs} tasks of its class"
        )


def reserve_after(
    runs: Sequence[TaskRun], turns_done: int, min_runs: int = MIN_RUNS
) -> Reserve | None:
    """The reserve after a task's `turns_done`-th turn, from its class's `runs`; None while
    there are fewer than `min_runs` of them."""
    if len(runs) < min_runs:
        return None
    turns = sum(r.turns for r in runs)
    gaps = sum(max(0, r.turns - 1) for r in runs)
    turn_s = sum(r.turn_s for r in runs) / turns if turns else 0.0
    gap_s = sum(r.between_s for r in runs) / gaps if gaps else 0.0
    tail_s = sum(r.tail_s for r in runs) / len(runs)
    longer = [r.turns - turns_done for r in runs if r.turns >= turns_done]
    more = sum(longer) / len(longer) if longer else 0.0
    seconds = more * (turn_s + gap_s) + tail_s
    return Reserve(seconds, more, turn_s, gap_s, tail_s, len(runs))


@dataclass(frozen=True, slots=True)
class TurnShare:
    """A turn's share of its task's deadline."""

    deadline_at: float
    """When the turn must have its first byte (the flight's alarm)."""
    given_s: float
    """Seconds from admission to `deadline_at`."""
    kept_s: float
    """Seconds of the task's deadline kept after `deadline_at` for its remaining work."""
    reserve: Reserve | None
    """What the class's history asked to keep; None: no history, nothing kept."""
    cut: bool = False
    """The turn's own need was beyond its share: it runs into the reserve."""


def turn_share(now: float, deadline_at: float, reserve: Reserve | None, need_s: float) -> TurnShare:
    """The share of a turn admitted at `now` under the task's `deadline_at`, given the
    reserve its class asks for and the turn's own `need_s` (the module docstring)."""
    left = deadline_at - now
    share = left - reserve.seconds if reserve is not None else left
    floor = min(max(need_s, 0.0), left)
    given = max(share, floor)
    return TurnShare(now + given, given, left - given, reserve, share < floor)
