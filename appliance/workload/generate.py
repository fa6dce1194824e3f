"""Agent workloads drawn from a spec: pure functions of (spec, seed), no clock, no I/O.

Model of the world (see `appliance.workload.model` for the values it produces): root tasks
arrive as a Poisson process at `root_tasks_per_s`; each draws its tenant and class by
weight, one of the class's prefix variants, its number of turns, and per turn the tokens
it appends (the statement first, then each tool's observation), its output and the tool
that runs after it with that tool's wait. A task whose next turn would pass
`max_context_tokens` stops there and fails, as agents that run out of context do; a task
whose tool call is abandoned (the class's `abandoned` share) ends after that turn, its tool
call never answered, and fails. A root that fans out picks a turn before its last; that
turn's tool is `subagent`, which starts the children at once and joins them before the
parent's next turn. Children share the
parent's tenant, class and prefix (its whole conversation too when the fan-out has
`fork_context`), draw their own statement, turns and outcome, carry no deadline of their own
(the parent's covers them) and do not fan out. A fan-out with `keep` keeps that many
children's results, drawn at random (a best-of-n picks the best answer, whichever ended
first); the spawning turn names the others in `discards`. A tool call of a class with
`announce_lead_s` draws how early its end is announced, at most its wait.

Determinism: root task i draws from `random.Random(f"{seed}/task/{i}")`, its announcement
leads from `f"{seed}/announce/{i}"` (so a spec without leads draws as before), the children
a fan-out with `keep` keeps from `f"{seed}/keep/{i}"` (so `keep` changes nothing else) and
arrivals from their own stream, so task i is the same whatever number of tasks is
generated, and the same seed and spec always give the same workload.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TypeVar

from appliance.workload.model import SUBAGENT_TOOL, AgentTask, AgentTurn, TaskTree, Workload
from appliance.workload.spec import Dist, TaskClass, WorkloadSpec

T = TypeVar("T")


def generate(spec: WorkloadSpec, *, root_tasks: int, seed: int | None = None) -> Workload:
    """The first `root_tasks` task trees of the spec's workload (`seed` overrides the spec's)."""
    if root_tasks < 0:
        raise ValueError(f"root_tasks must be >= 0, not {root_tasks}")
    seed = spec.seed if seed is None else seed
    return Workload(seed, tuple(itertools.islice(iter_trees(spec, seed=seed), root_tasks)))


def iter_trees(spec: WorkloadSpec, *, seed: int | None = None) -> Iterator[TaskTree]:
    """Task trees in arrival order, without end."""
    seed = spec.seed if seed is None else seed
    arrivals = random.Random(f"{seed}/arrivals")
    start_s = 0.0
    for index in itertools.count():
        start_s += arrivals.expovariate(spec.root_tasks_per_s)
        yield task_tree(spec, seed=seed, index=index, start_s=start_s)


def task_tree(spec: WorkloadSpec, *, seed: int, index: int, start_s: float) -> TaskTree:
    """Root task `index` of the workload and its children."""
    rng = random.Random(f"{seed}/task/{index}")
    tenant = _pick(rng, [t.name for t in spec.tenants], [t.weight for t in spec.tenants])
    cls = _pick(rng, spec.task_classes, [c.weight for c in spec.task_classes])
    task_id = f"t{index:06d}"
    variant = rng.randrange(cls.prefix_variants)
    prefix_id = f"{cls.name}/{variant}"
    turns, fits = _turns(rng, spec, cls, _draw_int(rng, cls.turns))
    deadline_s = None
    if cls.deadline is not None and rng.random() < cls.deadline.probability:
        deadline_s = round(rng.uniform(cls.deadline.min_s, cls.deadline.max_s), 3)
    children: list[AgentTask] = []
    fan = cls.fanout
    if fan is not None and len(turns) >= 2 and rng.random() < fan.probability:
        fork = rng.randrange(len(turns) - 1)
        count = rng.randint(fan.min_children, fan.max_children)
        for j in range(count):
            child_turns, child_fits = _turns(rng, spec, cls, _draw_int(rng, fan.child_turns))
            children.append(
                AgentTask(
                    task_id=f"{task_id}.{j}",
                    parent_id=task_id,
                    tenant=tenant,
                    task_class=cls.name,
                    start_s=0.0,
                    deadline_s=None,
                    succeeds=rng.random() < cls.success_rate and child_fits,
                    verified=rng.random() < cls.verified_rate,
                    prefix_id=prefix_id,
                    shared_prefix_tokens=cls.prefix_tokens,
                    turns=child_turns,
                )
            )
        spawn = replace(
            turns[fork],
            tool_class=SUBAGENT_TOOL,
            tool_wait_s=0.0,
            spawns=tuple(c.task_id for c in children),
            forks=fan.fork_context,
            discards=_discards(random.Random(f"{seed}/keep/{index}"), fan.keep, children),
        )
        turns = (*turns[:fork], spawn, *turns[fork + 1 :])
    root = AgentTask(
        task_id=task_id,
        parent_id=None,
        tenant=tenant,
        task_class=cls.name,
        start_s=round(start_s, 3),
        deadline_s=deadline_s,
        succeeds=rng.random() < cls.success_rate and fits,
        verified=rng.random() < cls.verified_rate,
        prefix_id=prefix_id,
        shared_prefix_tokens=cls.prefix_tokens,
        turns=turns,
    )
    return _with_leads(spec, random.Random(f"{seed}/announce/{index}"), root, children)


def _discards(
    rng: random.Random, keep: int | None, children: Sequence[AgentTask]
) -> tuple[str, ...]:
    """The children whose results the parent drops: all but `keep` drawn at random (None:
    none dropped, and nothing drawn)."""
    if keep is None:
        return ()
    kept = set(rng.sample(range(len(children)), keep))
    return tuple(c.task_id for i, c in enumerate(children) if i not in kept)


def _with_leads(
    spec: WorkloadSpec, rng: random.Random, root: AgentTask, children: Sequence[AgentTask]
) -> TaskTree:
    """The tree with each tool call's announcement lead drawn (none drawn when no tool
    class has one: the tree is as it was)."""
    if all(c.announce_lead_s is None for c in spec.tool_classes.values()):
        return TaskTree(root, tuple(children))

    def leads(task: AgentTask) -> AgentTask:
        turns = []
        for turn in task.turns:
            tool = spec.tool_classes.get(turn.tool_class or "")
            if tool is not None and tool.announce_lead_s is not None:
                lead_s = min(round(_draw(rng, tool.announce_lead_s), 3), turn.tool_wait_s)
                turn = replace(turn, announce_lead_s=lead_s)
            turns.append(turn)
        return replace(task, turns=tuple(turns))

    return TaskTree(leads(root), tuple(leads(c) for c in children))


def _turns(
    rng: random.Random, spec: WorkloadSpec, cls: TaskClass, n_turns: int
) -> tuple[tuple[AgentTurn, ...], bool]:
    """`n_turns` turns, or fewer when the context fills up (then False: the task fails)."""
    tools = list(cls.tools)
    weights = [cls.tools[t] for t in tools]
    room = spec.max_context_tokens - cls.prefix_tokens
    appended = _draw_int(rng, cls.statement_tokens)
    turns: list[AgentTurn] = []
    fits = True
    for k in range(n_turns):
        output = _draw_int(rng, cls.output_tokens)
        if appended + output > room:
            if k > 0:
                fits = False
                break
            appended = max(1, min(appended, room - output))  # the first turn always fits
            output = max(1, min(output, room - appended))
        room -= appended + output
        last = k == n_turns - 1
        tool = None if last else _pick(rng, tools, weights)
        wait_s = 0.0 if tool is None else round(_draw(rng, spec.tool_classes[tool]), 3)
        turns.append(AgentTurn(appended, output, tool, wait_s))
        if tool is not None and _abandons(rng, spec.tool_classes[tool].abandoned):
            return tuple(turns), False  # the session never comes back from this tool
        appended = _draw_int(rng, cls.observation_tokens)
    if not fits:  # the agent stops after the tool whose result no longer fits
        end = turns[-1]
        turns[-1] = AgentTurn(end.appended_tokens, end.output_tokens, None, 0.0)
    return tuple(turns), fits


def _abandons(rng: random.Random, share: float) -> bool:
    """Whether the session ends after this call (no draw when the class never ends one)."""
    return share > 0 and rng.random() < share


def _pick(rng: random.Random, items: Sequence[T], weights: Sequence[float]) -> T:
    return rng.choices(items, weights)[0]


def _draw(rng: random.Random, dist: Dist) -> float:
    sigma = dist.sigma
    value = rng.lognormvariate(math.log(dist.median), sigma) if sigma > 0 else dist.median
    return min(dist.max, max(dist.min, value))


def _draw_int(rng: random.Random, dist: Dist) -> int:
    return max(1, round(_draw(rng, dist)))
