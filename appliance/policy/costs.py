"""The task cost ledger's formulas: what one attempt costs, and cost per successful task.

The model of the world, in two rules:

1. One attempt (a turn) costs, in tokens mode,
       c_fresh*U + c_cached*H + c_out*(O - R) + c_reason*R + tool_cost
   with U fresh prompt tokens, H cached prompt tokens, O output tokens of which R are
   reasoning (vLLM's `completion_tokens` counts reasoning tokens, so each generated token
   is priced once: at the reasoning price when it is reasoning, else at the output price)
   and the c_* prices per million tokens; in gpu_seconds mode, gpu_s * gpu_second + tool_cost.
   The price is the version in effect at the attempt's end; the ledger stores the cost with
   the price id, so a new price never rewrites history.

2. Cost per successful task, per group (task_class, tenant, window of the ROOT task's
   creation time): every attempted cost of every task tree (failed, cancelled and retried
   attempts, discarded fan-out branches; a child task rolls up into its root) divided by
   the number of root tasks that succeeded with verified=true. Zero such successes gives
   None: the work bought nothing yet, which is neither free nor infinitely dear. A one-turn
   task closed `done` (its outcome unknown) counts as a task, never as a success. Each group
   also sums its attempts' GPU-seconds, the measure policy/overhead.py spreads the box's
   overhead by (gpu_seconds mode: idle awake time, energy, the box per hour); a group's cost
   per success then counts its share too, and without overhead it is the direct cost alone.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from appliance.domain.records import CostMode, Price, TaskStatus, TurnRecord

MTOK = 1_000_000
GROUP_KEYS = ("task_class", "tenant")


def attempt_cost(
    price: Price,
    *,
    fresh_tokens: int = 0,
    cached_tokens: int = 0,
    output_tokens: int = 0,
    reasoning_tokens: int = 0,
    gpu_s: float = 0.0,
    tool_cost: float = 0.0,
) -> float:
    if price.mode is CostMode.GPU_SECONDS:
        return gpu_s * price.gpu_second + tool_cost
    reasoning = min(reasoning_tokens, output_tokens)  # a part of the output, never more
    return (
        price.fresh_per_mtok * fresh_tokens
        + price.cached_per_mtok * cached_tokens
        + price.output_per_mtok * (output_tokens - reasoning)
        + price.reasoning_per_mtok * reasoning
    ) / MTOK + tool_cost


def turn_cost(turn: TurnRecord, price: Price) -> float:
    return attempt_cost(
        price,
        fresh_tokens=turn.fresh_tokens,
        cached_tokens=turn.cached_tokens,
        output_tokens=turn.output_tokens,
        reasoning_tokens=turn.reasoning_tokens,
        gpu_s=turn.gpu_s,
        tool_cost=turn.tool_cost,
    )


class PriceBook:
    """The price versions, ordered by effective_from; `at(t)` is the version in effect at t
    (the latest one that started at or before t; on a tie the one added last)."""

    def __init__(self, prices: Iterable[Price] = ()) -> None:
        self._starts: list[float] = []
        self._prices: list[Price] = []
        for p in prices:
            self.add(p)

    def add(self, price: Price) -> None:
        i = bisect.bisect_right(self._starts, price.effective_from)
        self._starts.insert(i, price.effective_from)
        self._prices.insert(i, price)

    def at(self, t: float) -> Price | None:
        i = bisect.bisect_right(self._starts, t)
        return self._prices[i - 1] if i else None

    def latest(self) -> Price | None:
        """The version with the latest start: the one new turns get."""
        return self._prices[-1] if self._prices else None


@dataclass(frozen=True, slots=True)
class TaskRow:
    task_id: str
    tenant: str
    created_at: float
    parent_task_id: str | None = None
    task_class: str | None = None
    status: TaskStatus = TaskStatus.OPEN
    verified: bool | None = None


@dataclass(frozen=True, slots=True)
class AttemptRow:
    """The cost of one attempt, or of `attempts` attempts of one task summed up (0: what its
    tools cost). cost None means unpriced (no price was in effect): it counts as an attempt,
    adds nothing."""

    task_id: str | None
    tenant: str
    at: float
    cost: float | None
    attempts: int = 1
    gpu_s: float = 0.0
    """The attempts' share of their workers' busy GPU-seconds (the turns' gpu_s)."""


@dataclass(frozen=True, slots=True)
class CostGroup:
    task_class: str | None
    tenant: str | None
    window_start: float | None
    tasks: int
    """Root tasks created in the window."""
    succeeded: int
    """Root tasks that succeeded with verified=true."""
    attempts: int
    unpriced_attempts: int
    cost: float
    """The direct cost: what the attempts (and the tools) were priced at."""
    cost_per_success: float | None
    """(cost + overhead) / succeeded."""
    gpu_s: float = 0.0
    overhead_idle: float = 0.0
    """The group's share of the idle awake GPU-seconds' cost (policy/overhead.py)."""
    overhead_energy: float = 0.0
    overhead_box: float = 0.0

    @property
    def overhead(self) -> float:
        return self.overhead_idle + self.overhead_energy + self.overhead_box

    @property
    def total_cost(self) -> float:
        return self.cost + self.overhead

    @property
    def direct_cost_per_success(self) -> float | None:
        return self.cost / self.succeeded if self.succeeded else None


@dataclass(slots=True)
class _Acc:
    tasks: int = 0
    succeeded: int = 0
    attempts: int = 0
    unpriced: int = 0
    costs: list[float] = field(default_factory=list)
    gpu_s: list[float] = field(default_factory=list)


def cost_per_success(
    tasks: Iterable[TaskRow],
    attempts: Iterable[AttemptRow],
    *,
    by: Sequence[str] = GROUP_KEYS,
    since: float | None = None,
    until: float | None = None,
    window_s: float | None = None,
) -> list[CostGroup]:
    """Rule 2 over plain rows; groups sorted by key. `since` is inclusive, `until`
    exclusive, both on the root's created_at; `window_s` splits that range into windows
    starting at `since` (or 0). The attempts of a task the rows do not list count as one
    root task of their own (its tenant, no class, created at its earliest attempt), and an
    attempt of no task as a root task alone, so no spent money goes missing."""
    unknown = set(by) - set(GROUP_KEYS)
    if unknown:
        raise ValueError(f"unknown group {sorted(unknown)[0]!r}; choose from {GROUP_KEYS}")
    if window_s is not None and window_s <= 0:
        raise ValueError("window_s must be positive")
    by_id = {t.task_id: t for t in tasks}
    roots = _Roots(by_id)
    spent, orphans = _spent_by_root(attempts, by_id, roots)

    groups: dict[tuple[str | None, str | None, float | None], _Acc] = {}
    all_roots = [t for t in by_id.values() if roots.of(t.task_id) == t.task_id]
    for root in [*all_roots, *orphans.values()]:
        if since is not None and root.created_at < since:
            continue
        if until is not None and root.created_at >= until:
            continue
        key = (
            root.task_class if "task_class" in by else None,
            root.tenant if "tenant" in by else None,
            _window(root.created_at, since, window_s),
        )
        acc = groups.setdefault(key, _Acc())
        acc.tasks += 1
        acc.succeeded += root.status is TaskStatus.SUCCEEDED and root.verified is True
        for a in spent.get(root.task_id, ()):
            acc.attempts += a.attempts
            acc.gpu_s.append(a.gpu_s)
            if a.cost is None:
                acc.unpriced += a.attempts
            else:
                acc.costs.append(a.cost)

    return [
        _cost_group(key, acc)
        for key, acc in sorted(groups.items(), key=lambda kv: _sort_key(kv[0]))
    ]


def _spent_by_root(
    attempts: Iterable[AttemptRow], by_id: dict[str, TaskRow], roots: _Roots
) -> tuple[dict[str, list[AttemptRow]], dict[str, TaskRow]]:
    """Each root's attempts, and a root row for each root the task rows do not list."""
    orphans: dict[str, TaskRow] = {}
    spent: dict[str, list[AttemptRow]] = {}
    for n, a in enumerate(attempts):
        if a.task_id is not None and a.task_id in by_id:
            root_id = roots.of(a.task_id)
        else:
            # An unknown task's attempts share one root; each task-less attempt is its own
            # (two name spaces, so a task named "0" never merges with attempt 0).
            root_id = f"\0task:{a.task_id}" if a.task_id is not None else f"\0attempt:{n}"
            seen = orphans.get(root_id)
            if seen is None or a.at < seen.created_at:
                orphans[root_id] = TaskRow(root_id, a.tenant, a.at)
        spent.setdefault(root_id, []).append(a)
    return spent, orphans


def _cost_group(key: tuple[str | None, str | None, float | None], acc: _Acc) -> CostGroup:
    cls, tenant, start = key
    cost = math.fsum(acc.costs)
    return CostGroup(
        task_class=cls,
        tenant=tenant,
        window_start=start,
        tasks=acc.tasks,
        succeeded=acc.succeeded,
        attempts=acc.attempts,
        unpriced_attempts=acc.unpriced,
        cost=cost,
        cost_per_success=cost / acc.succeeded if acc.succeeded else None,
        gpu_s=math.fsum(acc.gpu_s),
    )


class _Roots:
    """Finds each task's root by following parent links; a parent not among the rows (or a
    cycle) ends the walk, so the topmost known task is the root."""

    def __init__(self, by_id: dict[str, TaskRow]) -> None:
        self._by_id = by_id
        self._root: dict[str, str] = {}

    def of(self, task_id: str) -> str:
        path: list[str] = []
        seen: set[str] = set()
        current = task_id
        while current not in self._root:
            path.append(current)
            seen.add(current)
            parent = self._by_id[current].parent_task_id
            if parent is None or parent not in self._by_id or parent in seen:
                root = current
                break
            current = parent
        else:
            root = self._root[current]
        for t in path:
            self._root[t] = root
        return root


def _window(created_at: float, since: float | None, window_s: float | None) -> float | None:
    if window_s is None:
        return None
    origin = since if since is not None else 0.0
    return origin + math.floor((created_at - origin) / window_s) * window_s


def _sort_key(key: tuple[str | None, str | None, float | None]) -> tuple[str, str, float]:
    cls, tenant, start = key
    return (cls or "", tenant or "", start if start is not None else -math.inf)


def group_row(
    g: CostGroup, *, by: Sequence[str], currency: str | None, windowed: bool = False
) -> dict[str, object]:
    """One group as a report row: the `by` columns (and window_start), then the figures:
    the direct cost, the overhead share in parts, their total, and cost per success with
    the overhead and without it."""
    row: dict[str, object] = {key: getattr(g, key) for key in by}
    if windowed:
        row["window_start"] = g.window_start
    row |= {
        "tasks": g.tasks,
        "succeeded": g.succeeded,
        "attempts": g.attempts,
        "unpriced_attempts": g.unpriced_attempts,
        "gpu_s": g.gpu_s,
        "cost": g.cost,
        "overhead": g.overhead,
        "overhead_idle": g.overhead_idle,
        "overhead_energy": g.overhead_energy,
        "overhead_box": g.overhead_box,
        "total_cost": g.total_cost,
        "cost_per_success": g.cost_per_success,
        "direct_cost_per_success": g.direct_cost_per_success,
        "currency": currency,
    }
    return row
