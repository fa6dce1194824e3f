"""Closed-loop agent workloads: each task's next turn arrives when its previous turn has
finished plus that turn's tool wait, in the replay's virtual time.

Model of the world: a task (anything shaped like `AgentTaskLike`, e.g.
`appliance.workload.AgentTask`) is one agent session of `turns`. A root task's first turn
arrives at `start_s` with a prompt of `shared_prefix_tokens` (the same tokens for every task of
the tenant with the same `prefix_id`, else the same task class: a system prompt and tool
definitions) followed by the turn's `appended_tokens`; each later turn re-sends the whole
conversation so far (previous prompt and the tokens the engine generated) plus its own
`appended_tokens`, and arrives `tool_wait_s` after the previous turn finished. A turn that
`spawns` child tasks (optional field) starts each child `start_s` after it finished; the
parent's next turn arrives `tool_wait_s` after the last child ended (the orchestrator joins its
sub-agents); a child of a turn that `forks` (optional field) starts from the parent's whole
conversation so far instead of the prefix (a branch: the parent's exact tokens, so its exact
blocks). The parent drops, at the join, the children its spawning turn `discards` (optional
field): discarded branches, their descendants too. Appended tokens are pseudo-random, seeded by
task and turn, so runs are reproducible and tasks share nothing but their prefix (and a branch
its parent's conversation). Every request carries its tenant as `cache_salt` (tenants never
share cache entries, as in the appliance) and its task id as session id. A turn whose
conversation no longer fits `max_model_len` is not sent, and the task ends there unfinished.

A task whose last turn calls a tool (its session abandoned there: the tool never answers)
never completes. A task meets its deadline when all its turns finished by `start_s + deadline_s`
(`deadline_s` counts from the task's start, as `X-Deadline-S` does). Its GPU-seconds are
its requests' shares of the steps they ran in (`GpuSeconds`), its prefetches' included.

Events for a listener (`LoopListener`, optional), as timers of the replay: a tool call's
end announced (`tool_finished`) `announce_lead_s` (optional field, at most the wait) before
the turn it releases, 0 if not early (then just before the turn); and a child task's end
(`task_ended`): its last turn's end, or, when that turn called a tool that never answers,
when its client gives up.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from appliance.replay.kv_residency.residency import TurnHint
from appliance.sim.engine_io import DEFAULT_VOCAB_SIZE, SimRequest, StepResult, default_output_token
from appliance.sim.kv.prefetch_lane import PREFETCH_ID
from appliance.sim.runtime.virtual import Arrival, RequestRecord, Timer

Event = Arrival | Timer


class AgentTurnLike(Protocol):
    """A turn; an optional `spawns: tuple[str, ...]` names child tasks started after it."""

    @property
    def appended_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def tool_class(self) -> str | None:
        """The tool the agent runs after this turn (None: no tool call follows)."""
        ...

    @property
    def tool_wait_s(self) -> float: ...


class LoopListener(Protocol):
    """Told of the clients' announcements and of child tasks' ends, at their times; may
    answer with timers of its own."""

    def tool_finished(self, session_id: str, now: float) -> Sequence[Timer]: ...

    def task_ended(self, task_id: str, now: float) -> Sequence[Timer]: ...


class AgentTaskLike(Protocol):
    """A task; an optional `prefix_id: str` names its shared prefix (default: its class)."""

    @property
    def task_id(self) -> str: ...
    @property
    def parent_id(self) -> str | None: ...
    @property
    def tenant(self) -> str: ...
    @property
    def task_class(self) -> str: ...
    @property
    def start_s(self) -> float: ...
    @property
    def deadline_s(self) -> float | None: ...
    @property
    def succeeds(self) -> bool: ...
    @property
    def verified(self) -> bool: ...
    @property
    def shared_prefix_tokens(self) -> int: ...
    @property
    def turns(self) -> Sequence[AgentTurnLike]: ...


@dataclass(frozen=True, slots=True)
class TaskOutcome:
    """One task after the replay."""

    task_id: str
    parent_id: str | None
    tenant: str
    task_class: str
    start_s: float
    deadline_s: float | None
    turns: int
    turns_done: int
    finish_s: float | None
    """When its last finished turn finished (None: no turn finished)."""
    succeeds: bool
    verified: bool
    gpu_s: float
    abandoned: bool = False
    """Its last turn called a tool that never answered: the session walked away."""
    discarded: bool = False
    """A branch whose result its parent (or an ancestor) dropped when it joined it."""

    @property
    def completed(self) -> bool:
        return self.turns_done == self.turns and not self.abandoned

    @property
    def met_deadline(self) -> bool | None:
        if self.deadline_s is None:
            return None
        return (
            self.completed
            and self.finish_s is not None
            and self.finish_s <= self.start_s + self.deadline_s
        )


@dataclass(frozen=True, slots=True)
class BranchView:
    """A child task's session as a branch: its conversation so far (last prompt and what
    was generated) and how many of its first tokens are not its own (its prefix, or its
    parent's conversation when it forked)."""

    task_id: str
    parent_id: str
    tenant: str
    context: list[int]
    fork_tokens: int


@dataclass(slots=True)
class _Run:
    task: AgentTaskLike
    context: list[int] = field(default_factory=list)
    """The conversation so far: the last prompt and its generated tokens."""
    next_turn: int = 0
    turns_done: int = 0
    finish_s: float | None = None
    children: set[str] = field(default_factory=set)
    """Children it waits for before its next turn."""
    joined_s: float = 0.0
    """When the last of those children ended so far."""
    fork_tokens: int = 0
    """Tokens it started from that are not its own (its prefix, or its parent's conversation)."""


def _spawns(turn: AgentTurnLike, field: str = "spawns") -> tuple[str, ...]:
    return tuple(getattr(turn, field, ()))


def _lead_s(turn: AgentTurnLike) -> float:
    return min(float(getattr(turn, "announce_lead_s", 0.0)), turn.tool_wait_s)


class ClosedLoop:
    """Arrivals for `virtual.replay(..., on_finish=loop.on_finish)`, and the tasks' fate."""

    def __init__(
        self,
        tasks: Sequence[AgentTaskLike],
        *,
        max_model_len: int,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        seed: int = 0,
        listener: LoopListener | None = None,
    ) -> None:
        ids = [t.task_id for t in tasks]
        if len(set(ids)) != len(ids):
            raise ValueError("task ids must be unique")
        for t in tasks:
            if not t.turns:
                raise ValueError(f"task {t.task_id} has no turns")
            if any(u.appended_tokens < 0 or u.output_tokens < 1 for u in t.turns):
                raise ValueError(f"task {t.task_id}: a turn needs appended >= 0, output >= 1")
        self._parent: dict[str, str] = {}  # child task id -> the task that spawns it
        for t in tasks:
            for turn in t.turns:
                for child in _spawns(turn):
                    if child not in ids:
                        raise ValueError(f"task {t.task_id} spawns unknown task {child}")
                    self._parent[child] = t.task_id
                if not set(_spawns(turn, "discards")) <= set(_spawns(turn)):
                    raise ValueError(f"task {t.task_id} discards a child it does not spawn")
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.seed = seed
        self.listener = listener
        self._runs = {t.task_id: _Run(t) for t in sorted(tasks, key=lambda t: t.start_s)}
        self._prefixes: dict[tuple[str, str], tuple[random.Random, list[int]]] = {}
        self._turn_of: dict[str, tuple[str, int]] = {}  # request id -> (task id, turn)
        self._discarded: set[str] = set()  # children dropped at their parent's join

    # --- driving the replay ---

    def arrivals(self) -> Iterator[Arrival]:
        """Every root task's first turn, in start order (the rest come from `on_finish`)."""
        for run in self._runs.values():
            if run.task.task_id not in self._parent:
                yield from self._start(run, run.task.start_s)

    def on_finish(self, rec: RequestRecord) -> list[Event]:
        task_id, k = self._turn_of[rec.request_id]
        run = self._runs[task_id]
        now = rec.finish_s if rec.finish_s is not None else rec.arrival_s
        run.turns_done += 1
        run.finish_s = now
        req_stub = SimRequest(rec.request_id, [], 1)
        run.context.extend(default_output_token(req_stub, i) for i in range(rec.output_tokens))
        turn = run.task.turns[k]
        children = _spawns(turn)
        out: list[Event] = []
        if children:
            run.children = set(children)
            run.joined_s = now
            for child in children:
                child_run = self._runs[child]
                forked = run.context if getattr(turn, "forks", False) else None
                out += self._start(child_run, now + child_run.task.start_s, forked)
            return out  # the next turn comes when the last child has ended (`_ended`)
        if k + 1 < len(run.task.turns):
            return self._next(run, now + turn.tool_wait_s, _lead_s(turn))
        return self._ended(run, now + turn.tool_wait_s)  # a last tool call: it gave up then

    def branch(self, task_id: str) -> BranchView | None:
        """A child task as a branch of its parent (None: a root, or unknown)."""
        parent_id = self._parent.get(task_id)
        if parent_id is None:
            return None
        run = self._runs[task_id]
        return BranchView(task_id, parent_id, run.task.tenant, run.context, run.fork_tokens)

    def hint(self, request_id: str) -> TurnHint | None:
        """What the task says about a turn's end: whether a tool call follows, which, how long."""
        where = self._turn_of.get(request_id)
        if where is None:
            return None
        turns = self._runs[where[0]].task.turns
        turn = turns[where[1]]
        tool = turn.tool_class
        wait_s = turn.tool_wait_s if tool is not None else None
        ends = where[1] + 1 == len(turns) and not _spawns(turn)
        return TurnHint(tool is not None, tool, wait_s, session_ends=ends)

    def previous_tool(self, request_id: str) -> str | None:
        """The tool the task waited on before this turn (None: its first turn)."""
        where = self._turn_of.get(request_id)
        if where is None or where[1] == 0:
            return None
        return self._runs[where[0]].task.turns[where[1] - 1].tool_class

    def discarded(self, task_id: str) -> bool:
        """Whether the task, or an ancestor, was dropped at its parent's join."""
        while task_id not in self._discarded and task_id in self._parent:
            task_id = self._parent[task_id]
        return task_id in self._discarded

    def sessions(self) -> dict[str, str]:
        """Request id -> task id, for every request sent."""
        return {rid: task_id for rid, (task_id, _) in self._turn_of.items()}

    def outcomes(self, gpu_s: Mapping[str, float]) -> list[TaskOutcome]:
        spent: dict[str, float] = {}
        for rid, (task_id, _) in self._turn_of.items():
            spent[task_id] = spent.get(task_id, 0.0) + gpu_s.get(rid, 0.0)
        for rid, seconds in gpu_s.items():
            if rid.startswith(PREFETCH_ID):  # `prefetch:SESSION:N`: its task's
                task_id = rid.split(":")[1]
                spent[task_id] = spent.get(task_id, 0.0) + seconds
        return [
            TaskOutcome(
                task_id=t.task_id,
                parent_id=t.parent_id,
                tenant=t.tenant,
                task_class=t.task_class,
                start_s=t.start_s,
                deadline_s=t.deadline_s,
                turns=len(t.turns),
                turns_done=run.turns_done,
                finish_s=run.finish_s,
                succeeds=t.succeeds,
                verified=t.verified,
                gpu_s=spent.get(t.task_id, 0.0),
                abandoned=t.turns[-1].tool_class is not None,
                discarded=self.discarded(t.task_id),
            )
            for run in self._runs.values()
            for t in (run.task,)
        ]

    # --- the loop ---

    def _start(self, run: _Run, at_s: float, forked: list[int] | None = None) -> list[Event]:
        t = run.task
        if forked is not None:
            run.context = list(forked)
        else:
            key = str(getattr(t, "prefix_id", t.task_class))
            run.context = self._prefix(t.tenant, key, t.shared_prefix_tokens)
        run.fork_tokens = len(run.context)
        return self._next(run, at_s)

    def _next(self, run: _Run, at_s: float, lead_s: float | None = None) -> list[Event]:
        """The task's next turn at `at_s`, or its end there when that turn cannot be sent;
        after a tool call (`lead_s`), its end announced that much before."""
        arrival = self._turn(run, at_s)
        if arrival is None:
            return self._ended(run, at_s)
        listener, sid = self.listener, run.task.task_id
        if listener is None or lead_s is None:
            return [arrival]
        return [Timer(at_s - lead_s, lambda now: listener.tool_finished(sid, now)), arrival]

    def _ended(self, run: _Run, at_s: float) -> list[Event]:
        """A task has no more turns: its parent resumes once its last child has ended."""
        task_id = run.task.task_id
        parent_id = self._parent.get(task_id)
        if parent_id is None:
            return []
        out: list[Event] = []
        if (listener := self.listener) is not None:
            out.append(Timer(at_s, lambda now: listener.task_ended(task_id, now)))
        parent = self._runs[parent_id]
        parent.children.discard(task_id)
        parent.joined_s = max(parent.joined_s, at_s)
        if parent.children:
            return out
        k = parent.next_turn - 1  # the turn that spawned
        self._discarded.update(_spawns(parent.task.turns[k], "discards"))  # the join
        if k + 1 >= len(parent.task.turns):
            return out + self._ended(parent, parent.joined_s)
        at_s = parent.joined_s + parent.task.turns[k].tool_wait_s
        return out + self._next(parent, at_s, _lead_s(parent.task.turns[k]))

    # --- prompts ---

    def _turn(self, run: _Run, at_s: float) -> Arrival | None:
        t, k = run.task, run.next_turn
        if k >= len(t.turns):
            return None
        turn = t.turns[k]
        rng = random.Random(f"{self.seed}/{t.task_id}/{k}")
        run.context.extend(rng.choices(range(self.vocab_size), k=turn.appended_tokens))
        if not run.context or len(run.context) >= self.max_model_len:
            return None
        run.next_turn += 1
        rid = f"{t.task_id}/{k}"
        self._turn_of[rid] = (t.task_id, k)
        request = SimRequest(
            request_id=rid,
            prompt_token_ids=list(run.context),
            max_tokens=turn.output_tokens,
            cache_salt=t.tenant,
            session_id=t.task_id,
            arrival_s=at_s,
        )
        return Arrival(at_s, request)

    def _prefix(self, tenant: str, prefix_id: str, n: int) -> list[int]:
        """The first `n` tokens of the tenant's shared prefix `prefix_id`."""
        rng, tokens = self._prefixes.setdefault(
            (tenant, prefix_id), (random.Random(f"{self.seed}/{tenant}/{prefix_id}"), [])
        )
        if n > len(tokens):
            tokens.extend(rng.choices(range(self.vocab_size), k=n - len(tokens)))
        return tokens[:n]


class GpuSeconds:
    """Per-request GPU-seconds: each step's duration split over the requests it scheduled,
    in proportion to their scheduled tokens (an `on_step` watcher)."""

    def __init__(self) -> None:
        self.by_request: dict[str, float] = {}

    def on_step(self, i: int, now: float, result: StepResult) -> None:
        total = result.num_scheduled_tokens
        if not total:
            return
        per_token = result.duration_s / total
        spent = self.by_request
        for rid, n in result.scheduled.items():
            spent[rid] = spent.get(rid, 0.0) + per_token * n
