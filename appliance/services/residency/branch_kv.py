"""Per task, what its sessions' KV inherited from its parent task, what is its own, and what
its end reclaimed when: the tasks view of the state (`/admin/v1/state`, the console's tree).

Model of the world: a child task's session starts from its parent's prompt, so the leading
blocks of its prefix are the parent's (shared, never its own); the rest is branch-local.
When a task closes, the idle reaper drops each of its sessions' own blocks on every tier and
leaves what they share with the parent (`ReaperLoop._session_ended`); `BranchEnds` keeps
what that reclaimed, per task, for the newest `BRANCH_ENDS_KEPT` tasks (the ledger's
`residency_events` keep every one).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from appliance.domain.records import TaskId
from appliance.services.residency.residency_inputs import inherited_blocks
from appliance.services.sessions.sessions import SessionState

BRANCH_ENDS_KEPT = 1000
"""As many as the task book keeps settled tasks (`settled_tasks.py`)."""


@dataclass(frozen=True, slots=True)
class BranchReclaim:
    """What a task's end reclaimed: its sessions' own tokens, dropped on every tier."""

    at: float
    """When the last of its sessions ended."""
    own_tokens: int
    inherited_tokens: int
    """Left to its parent's sessions."""


class BranchEnds:
    """The reclaims of the newest ended tasks, oldest forgotten first."""

    def __init__(self, kept: int = BRANCH_ENDS_KEPT) -> None:
        self._ends: OrderedDict[TaskId, BranchReclaim] = OrderedDict()
        self._kept = kept

    def ended(self, task: TaskId, at: float, own_tokens: int, inherited_tokens: int) -> None:
        """One of the task's sessions ended: its reclaim adds to the task's."""
        was = self._ends.pop(task, None)
        end = BranchReclaim(at, own_tokens, inherited_tokens)
        if was is not None:
            end = replace(
                end,
                own_tokens=was.own_tokens + own_tokens,
                inherited_tokens=was.inherited_tokens + inherited_tokens,
            )
        self._ends[task] = end
        while len(self._ends) > self._kept:
            self._ends.popitem(last=False)

    def get(self, task: TaskId) -> BranchReclaim | None:
        return self._ends.get(task)


@dataclass(frozen=True, slots=True)
class TaskKv:
    """A task's KV now, over its sessions, in tokens (each session's prefix counted where
    it is most: GPU or host)."""

    inherited_tokens: int = 0
    """Shared with its parent's sessions: the parent's."""
    own_tokens: int = 0
    """Past what it inherited: branch-local, cached on some tier."""
    own_kept_tokens: int = 0
    """Of `own_tokens`, what is held on a GPU or kept on a host tier (not merely cached):
    what its end reclaims, 0 within a reaper tick of it."""
    reclaimed: BranchReclaim | None = None


def task_kv(
    sessions: Iterable[tuple[SessionState, Mapping[str, int]]],
    parent_of: Callable[[TaskId], TaskId | None],
    ended: Callable[[TaskId], BranchReclaim | None],
) -> dict[TaskId, TaskKv]:
    """Per task with a session: its KV. `sessions`: each session with its prefix by tier
    now (`SessionKvNow.most()`: gpu, gpu_held, host)."""
    listed = list(sessions)
    states = [s for s, _ in listed]
    sums: dict[TaskId, tuple[int, int, int]] = {}
    for s, tiers in listed:
        if s.task_id is None:
            continue
        resident = max(tiers.get("gpu", 0), tiers.get("host", 0))
        kept = max(tiers.get("gpu_held", 0), tiers.get("host", 0))
        block = s.chain.block_size if s.chain is not None else 0
        shared = min(resident, inherited_blocks(parent_of, s, states) * block)
        was = sums.get(s.task_id, (0, 0, 0))
        add = (shared, resident - shared, max(0, kept - shared))
        sums[s.task_id] = (was[0] + add[0], was[1] + add[1], was[2] + add[2])
    return {t: TaskKv(*n, reclaimed=ended(t)) for t, n in sums.items()}


def task_kv_of(views: Mapping[TaskId, TaskKv], task: TaskId, ended: BranchReclaim | None) -> TaskKv:
    """A task's view, or, for a task with no session now, only its reclaim (if any)."""
    return views.get(task) or TaskKv(reclaimed=ended)
