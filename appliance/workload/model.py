"""The agent workload as plain values: tasks, their turns, their fan-out and their outcomes.

Model of the world: an agent task is a loop of model calls (turns). Its context starts with
a prefix shared by every task of its kind (system prompt and tool schemas, `prefix_id` names
the text, the same id the same tokens), then the task statement; each turn appends new tokens
(turn 0: the statement; later turns: the previous tool's result, the observation), calls the
model for `output_tokens`, and then runs a tool of `tool_class` for `tool_wait_s` (none after
the last turn), whose end the client may announce before the next turn
(`announce_lead_s`). A turn that `spawns` child tasks waits for all of them to finish before
the parent's next turn (the orchestrator joins its sub-agents) and may then drop some of
their results (`discards`: branches it does not keep); children carry the parent's
prefix, tenant and class, and with `forks` start from the parent's whole conversation. A
task ends with an outcome: succeeded or failed, and whether the outcome was verified (tests
ran, a reviewer approved). Times are seconds, counts tokens.

Nothing here knows about HTTP or a clock: the same values drive the live benchmark and the
virtual-time replay.
"""

from __future__ import annotations

from dataclasses import dataclass

SUBAGENT_TOOL = "subagent"
"""The tool class of a turn that spawns child tasks and waits for them."""


@dataclass(frozen=True, slots=True)
class AgentTurn:
    appended_tokens: int
    """New tokens this turn adds before its model call (statement or tool observation)."""
    output_tokens: int
    """Tokens the model generates on this turn."""
    tool_class: str | None
    """The tool run after this turn; None after the last turn."""
    tool_wait_s: float
    """How long that tool runs (for `subagent`: the overhead beyond waiting for children)."""
    spawns: tuple[str, ...] = ()
    """Task ids of the children started after this turn."""
    forks: bool = False
    """Those children start from this task's conversation so far (branches of it), not
    only from its prefix."""
    discards: tuple[str, ...] = ()
    """Of `spawns`, the children whose results the task drops when it joins them
    (discarded branches: a best-of-n keeps one); () keeps them all."""
    announce_lead_s: float = 0.0
    """How long before the next turn the client announces the tool's end (`tool_finished`);
    0: not early, with the turn. At most `tool_wait_s`."""


@dataclass(frozen=True, slots=True)
class AgentTask:
    task_id: str
    parent_id: str | None
    tenant: str
    task_class: str
    start_s: float
    """A root: seconds from the start of the workload (open-loop arrival). A child: seconds
    after its parent's spawning turn finished."""
    deadline_s: float | None
    """Seconds the whole task may take from its start; None: no deadline."""
    succeeds: bool
    verified: bool
    prefix_id: str
    shared_prefix_tokens: int
    turns: tuple[AgentTurn, ...]

    def prompt_tokens(self, turn: int) -> int:
        """The prompt of turn `turn`: prefix, every earlier turn's appended and output tokens,
        and this turn's appended tokens (chat-template tokens not counted)."""
        before = sum(t.appended_tokens + t.output_tokens for t in self.turns[:turn])
        return self.shared_prefix_tokens + before + self.turns[turn].appended_tokens

    @property
    def context_tokens(self) -> int:
        """Prefix plus everything every turn appended and generated."""
        return self.shared_prefix_tokens + sum(
            t.appended_tokens + t.output_tokens for t in self.turns
        )

    @property
    def tool_wait_s(self) -> float:
        return sum(t.tool_wait_s for t in self.turns)


@dataclass(frozen=True, slots=True)
class TaskTree:
    """One root task and its descendants, the unit an agent slot runs."""

    root: AgentTask
    children: tuple[AgentTask, ...] = ()

    @property
    def tasks(self) -> tuple[AgentTask, ...]:
        return (self.root, *self.children)

    def child(self, task_id: str) -> AgentTask:
        for c in self.children:
            if c.task_id == task_id:
                return c
        raise KeyError(task_id)


@dataclass(frozen=True, slots=True)
class Workload:
    seed: int
    trees: tuple[TaskTree, ...]

    @property
    def tasks(self) -> tuple[AgentTask, ...]:
        return tuple(t for tree in self.trees for t in tree.tasks)
