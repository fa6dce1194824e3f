"""Agent sessions driven against a running appliance, in real time, until the run stops.

Model of the world: `concurrency` slots each run one root task tree at a time, taking the
next tree from the workload when theirs ends (closed loop; children fanned out by a root
run beside it, so more than `concurrency` sessions may be active). A task is created with
`POST /v1/tasks` (parent, class, deadline), then each turn re-sends the whole chat so far
(system prefix, statement, then assistant replies and tool observations as user messages,
SWE-agent style) as one streamed model call with the agent headers; after a turn its tool
runs as an `asyncio` sleep of `tool_wait_s * time_scale`, bracketed by `tool_started` and
`tool_finished` events, or its children run and are joined. After the last turn the task
reports its outcome (`succeeded`/`failed`, `verified`). Deadlines are wall-clock budgets
and do not shrink with the tool waits; `X-Deadline-S` carries the seconds left.

Stopping: at `duration_s` no new turn, task or tool wait starts; turns in flight may finish
for `drain_s` more, then their streams are closed (counted as abandoned). Root tasks left
open are cancelled through the API, so the appliance holds nothing for them afterwards.
A failed model call ends its task as failed (an agent without its reply cannot go on);
a task that would pass the model's context ends as failed before the call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from appliance.bench.client import ApplianceClient
from appliance.bench.report import Recorder, TaskResult
from appliance.workload.model import SUBAGENT_TOOL, AgentTask, AgentTurn, TaskTree
from appliance.workload.text import words

MESSAGE_OVERHEAD_TOKENS = 8
"""Chat-template tokens allowed per message when checking a prompt against the model."""


@dataclass(frozen=True, slots=True)
class RunPlan:
    run_tag: str
    """Prefix of every task and session id of this run (the ledger's rows carry it)."""
    duration_s: float
    drain_s: float
    time_scale: float
    max_model_len: int | None


class Agents:
    def __init__(
        self, clients: Mapping[str, ApplianceClient], plan: RunPlan, rec: Recorder
    ) -> None:
        self._clients = clients
        self._plan = plan
        self._rec = rec
        self._stop = asyncio.Event()
        self._open_roots: dict[str, ApplianceClient] = {}

    async def run(self, trees: Iterator[TaskTree], concurrency: int) -> None:
        async def slot() -> None:
            while not self._stop.is_set():
                tree = next(trees, None)
                if tree is None:
                    return
                await self._task(tree, tree.root, None)

        slots = [asyncio.create_task(slot()) for _ in range(concurrency)]
        _, pending = await asyncio.wait(slots, timeout=self._plan.duration_s)
        self._stop.set()
        if pending:
            _, pending = await asyncio.wait(pending, timeout=self._plan.drain_s)
        for p in pending:
            p.cancel()
        results = await asyncio.gather(*slots, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                raise r
        for client_id, client in list(self._open_roots.items()):
            answer = await client.cancel(client_id)
            if not answer.ok:
                self._rec.events_failed += 1
                self._rec.error(f"cancel: {answer.error}")

    def _client_id(self, task: AgentTask) -> str:
        return f"{self._plan.run_tag}-{task.task_id}"

    async def _task(self, tree: TaskTree, task: AgentTask, parent_id: str | None) -> None:
        client = self._clients[task.tenant]
        client_id = self._client_id(task)
        deadline_s = task.deadline_s
        answer = await client.create_task(
            client_id, parent_id=parent_id, task_class=task.task_class, deadline_s=deadline_s
        )
        if not answer.ok:
            self._rec.rejected_tasks += 1
            self._rec.error(f"create task: {answer.error}")
            if parent_id is None:  # admission said no: back off before the next root
                await self._wait(min(answer.retry_after_s or 0.1, 5.0))
            return
        loop = asyncio.get_running_loop()
        start = loop.time()
        if parent_id is None:
            self._open_roots[client_id] = client
        outcome, reason, turns = "unfinished", None, 0
        try:
            outcome, reason, turns = await self._turns(
                tree, task, client, client_id, parent_id, start, deadline_s
            )
            if outcome != "unfinished":
                verified = task.verified if reason is None else False
                answer = await client.event(client_id, outcome, verified=verified)
                if answer.ok:
                    self._open_roots.pop(client_id, None)
                else:
                    self._rec.events_failed += 1
                    self._rec.error(f"{outcome} event: {answer.error}")
                    outcome, reason = "unfinished", answer.error
        finally:
            latency_s = loop.time() - start
            self._rec.tasks.append(
                TaskResult(
                    task_id=client_id,
                    root=parent_id is None,
                    outcome=outcome,
                    verified=outcome != "unfinished" and reason is None and task.verified,
                    turns=turns,
                    latency_s=latency_s,
                    deadline_missed=deadline_s is not None and latency_s > deadline_s,
                    reason=reason,
                )
            )

    async def _turns(
        self,
        tree: TaskTree,
        task: AgentTask,
        client: ApplianceClient,
        client_id: str,
        parent_id: str | None,
        start: float,
        deadline_s: float | None,
    ) -> tuple[str, str | None, int]:
        """(outcome, reason, turns done): outcome "unfinished" when the run stopped it."""
        tag, scale = self._plan.run_tag, self._plan.time_scale
        messages: list[dict[str, str]] = []
        if task.shared_prefix_tokens > 0:
            prefix = words(f"prefix/{task.prefix_id}", task.shared_prefix_tokens)
            messages.append({"role": "system", "content": prefix})
        context_tokens = task.shared_prefix_tokens + MESSAGE_OVERHEAD_TOKENS
        loop = asyncio.get_running_loop()
        for k, turn in enumerate(task.turns):
            content = words(f"{tag}/{task.task_id}/{k}", turn.appended_tokens)
            messages.append({"role": "user", "content": content})
            context_tokens += turn.appended_tokens + MESSAGE_OVERHEAD_TOKENS
            if self._stop.is_set():
                return "unfinished", None, k
            limit = self._plan.max_model_len
            if limit is not None and context_tokens + turn.output_tokens > limit:
                return "failed", "the prompt would pass the model's context", k
            headers = self._headers(turn, client_id, parent_id, deadline_s, loop.time() - start)
            try:
                result, text = await client.step(
                    client_id, messages, output_tokens=turn.output_tokens, headers=headers
                )
            except asyncio.CancelledError:
                self._rec.abandoned_steps += 1
                raise
            self._rec.steps.append(result)
            if not result.ok:  # rejected by admission or failed: the agent cannot go on
                self._rec.error(result.error or "failed step")
                return "failed", result.error, k
            messages.append({"role": "assistant", "content": text})
            context_tokens = result.prompt_tokens + result.output_tokens
            context_tokens += MESSAGE_OVERHEAD_TOKENS
            if turn.spawns:
                await self._event(client, client_id, "tool_started", SUBAGENT_TOOL, None)
                await asyncio.gather(
                    *(self._child(tree, tree.child(c), client_id) for c in turn.spawns)
                )
                if self._stop.is_set():
                    return "unfinished", None, k + 1
                await self._event(client, client_id, "tool_finished", SUBAGENT_TOOL, None)
            elif turn.tool_class is not None:
                wait_s = turn.tool_wait_s * scale
                await self._event(client, client_id, "tool_started", turn.tool_class, wait_s)
                if not await self._wait(wait_s):
                    return "unfinished", None, k + 1
                await self._event(client, client_id, "tool_finished", turn.tool_class, None)
        return ("succeeded" if task.succeeds else "failed"), None, len(task.turns)

    async def _child(self, tree: TaskTree, child: AgentTask, parent_id: str) -> None:
        if child.start_s > 0 and not await self._wait(child.start_s * self._plan.time_scale):
            return
        if not self._stop.is_set():
            await self._task(tree, child, parent_id)

    def _headers(
        self,
        turn: AgentTurn,
        client_id: str,
        parent_id: str | None,
        deadline_s: float | None,
        elapsed_s: float,
    ) -> dict[str, str]:
        headers = {"X-Session-ID": client_id, "X-Task-ID": client_id}
        if parent_id is not None:
            headers["X-Parent-Task-ID"] = parent_id
        if turn.tool_class is not None:
            headers["X-Tool-Class"] = turn.tool_class
            if turn.tool_class != SUBAGENT_TOOL:
                wait_s = turn.tool_wait_s * self._plan.time_scale
                headers["X-Expected-Tool-Wait-S"] = f"{wait_s:.3f}"
        if deadline_s is not None:
            headers["X-Deadline-S"] = f"{max(0.0, deadline_s - elapsed_s):.3f}"
        return headers

    async def _event(
        self,
        client: ApplianceClient,
        client_id: str,
        kind: str,
        tool_class: str,
        expected_s: float | None,
    ) -> None:
        answer = await client.event(client_id, kind, tool_class=tool_class, expected_s=expected_s)
        if not answer.ok:
            self._rec.events_failed += 1
            self._rec.error(f"{kind} event: {answer.error}")

    async def _wait(self, seconds: float) -> bool:
        return await sleep_unless_stopped(self._stop, seconds)


async def sleep_unless_stopped(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds`; False when `stop` was set first (or is set already)."""
    if seconds <= 0:
        return not stop.is_set()
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        return True
    return False
