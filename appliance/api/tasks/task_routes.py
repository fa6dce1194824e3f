"""The task routes: create a task, report its events, cancel it (with its open
descendants), read it as a tree. Each change is acknowledged by the ledger before the
client hears it is done."""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from appliance.api.context import ApiContext, Guard
from appliance.api.errors import RequestRefused
from appliance.api.tasks.idempotency import IdempotencyKeys
from appliance.api.turns.requests import agent_headers, identifier, parse_json_body
from appliance.domain.errors import LedgerError
from appliance.domain.records import TaskEventType, TurnOutcome


class TaskRoutes:
    def __init__(self, ctx: ApiContext) -> None:
        self._ctx = ctx
        self._keyed = IdempotencyKeys(lambda request: ctx.keys.caller(request.headers).tenant)

    def routes(self, guarded: Guard) -> list[Route]:
        once = self._keyed  # changes honour Idempotency-Key
        return [
            Route("/v1/tasks", guarded(once(self.create_task)), methods=["POST"]),
            Route("/v1/tasks/{task_id}", guarded(self.get_task), methods=["GET"]),
            Route("/v1/tasks/{task_id}/events", guarded(once(self.task_event)), methods=["POST"]),
            Route("/v1/tasks/{task_id}/cancel", guarded(once(self.cancel_task)), methods=["POST"]),
        ]

    async def create_task(self, request: Request) -> Response:
        who = self._ctx.keys.caller(request.headers)
        raw = await request.body()
        new = new_task(parse_json_body(raw) if raw else {})
        known = self._ctx.tasks.get(who.tenant, new.client_id)
        if known is not None and self._ctx.tasks.repeats(
            known, parent_id=new.parent_id, task_class=new.task_class
        ):  # a client's retry after a timeout: the task it created, not a second one
            await _written(known.written)
            return JSONResponse(
                {
                    "task_id": new.client_id,
                    "deadline_at": known.deadline_at,
                    "status": known.status.value,
                },
                status_code=200,
            )
        if known is not None:  # held, or only the ledger's (closed before a restart, say)
            raise RequestRefused(409, f"task {new.client_id} exists already", "task_exists")
        if new.parent_id is not None and self._ctx.tasks.get(who.tenant, new.parent_id) is None:
            raise RequestRefused(
                404,
                f"parent task {new.parent_id} not found",
                "task_not_found",
                param="parent_task_id",
            )
        self._ctx.tasks.check_parent(who.tenant, new.parent_id)  # before admission counts it
        key = self._ctx.tasks.key
        if self._ctx.admission is not None:
            await self._ctx.admission.admit_task(
                who.tenant,
                key(who.tenant, new.client_id),
                parent=key(who.tenant, new.parent_id) if new.parent_id else None,
                deadline_s=new.deadline_s,
                priority=agent_headers(request.headers, {}).priority,
            )
        task = self._ctx.tasks.create(
            who.tenant,
            new.client_id,
            self._ctx.clock.now(),
            parent_id=new.parent_id,
            task_class=new.task_class,
            deadline_s=new.deadline_s,
            budget=new.budget,
            max_children=new.max_children,
        )
        try:
            await _written(task.written)
        except LedgerError:  # memory never runs ahead of the ledger
            self._ctx.tasks.drop(task)
            raise
        return JSONResponse(
            {
                "task_id": new.client_id,
                "deadline_at": task.deadline_at,
                "status": task.status.value,
            },
            status_code=201,
        )

    async def task_event(self, request: Request) -> Response:
        who = self._ctx.keys.caller(request.headers)
        event = task_event(parse_json_body(await request.body()))
        task = self._ctx.tasks.event(
            who.tenant,
            request.path_params["task_id"],
            event.kind,
            self._ctx.clock.now(),
            verified=event.verified,
            evidence=event.evidence,
            tool_class=event.tool_class,
            expected_s=event.expected_s,
            cost=event.cost,
        )
        await _written(task.written)  # a refused write took the change back
        answer: dict[str, Any] = {"task_id": task.client_id, "status": task.status.value}
        if event.kind == TaskEventType.CANCELLED:
            self._ctx.desk.stop(task.key)
        elif event.kind == TaskEventType.SUCCEEDED:
            discarded = self._ctx.tasks.discard_branches(task, self._ctx.clock.now())
            for kid in discarded:
                self._ctx.desk.stop(kid.key, TurnOutcome.DISCARDED)  # their turns in flight
                await _written(kid.written)
            if discarded:
                answer["discarded"] = [kid.client_id for kid in discarded]
        return JSONResponse(answer)

    async def cancel_task(self, request: Request) -> Response:
        who = self._ctx.keys.caller(request.headers)
        cancelled = self._ctx.tasks.cancel(
            who.tenant, request.path_params["task_id"], self._ctx.clock.now()
        )
        for task in cancelled:
            self._ctx.desk.stop(task.key)  # its turns in flight end too
            await _written(task.written)
        return JSONResponse({"cancelled": [t.client_id for t in cancelled]})

    async def get_task(self, request: Request) -> Response:
        who = self._ctx.keys.caller(request.headers)
        tasks, client_id = self._ctx.tasks, request.path_params["task_id"]
        task = tasks.find(tasks.key(who.tenant, client_id))
        # One the book no longer holds is the ledger's (read in a thread: a tree of rows).
        doc = (
            tasks.tree(task)
            if task
            else await asyncio.to_thread(tasks.archived, who.tenant, client_id)
        )
        if doc is None:
            raise RequestRefused(404, f"task {client_id} not found", "task_not_found")
        return JSONResponse(doc)


async def _written(fut: Any) -> None:
    """Waits for the ledger to acknowledge a change before the client hears it is done."""
    if fut is not None:
        await asyncio.wrap_future(fut)


MAX_EVIDENCE_CHARS = 65536
MAX_TOOL_COST = 1_000_000.0
"""The most one tool_finished event may say its tool cost, in the ledger's currency."""


@dataclass(frozen=True, slots=True)
class NewTask:
    client_id: str
    parent_id: str | None
    task_class: str | None
    deadline_s: float | None
    budget: float | None
    max_children: int | None


def new_task(body: dict[str, Any]) -> NewTask:
    """A task creation's fields, each checked (400 naming the field) before anything changes."""
    task_id = body.get("task_id")
    client_id = identifier(task_id, "task_id") if task_id is not None else None
    parent = body.get("parent_task_id")
    parent_id = identifier(parent, "parent_task_id") if parent is not None else None
    if parent_id is not None and parent_id == client_id:
        raise RequestRefused(
            400, "a task cannot be its own parent", "invalid_value", param="parent_task_id"
        )
    task_class = body.get("task_class")
    return NewTask(
        client_id=client_id or f"task-{uuid.uuid4().hex[:16]}",
        parent_id=parent_id,
        task_class=identifier(task_class, "task_class") if task_class is not None else None,
        deadline_s=_number(body, "deadline_s", positive=True),
        budget=_number(body, "budget"),
        max_children=_count(body, "max_children"),
    )


@dataclass(frozen=True, slots=True)
class TaskEventFields:
    kind: TaskEventType
    verified: bool | None
    evidence: str | None
    tool_class: str | None
    expected_s: float | None
    cost: float


def task_event(body: dict[str, Any]) -> TaskEventFields:
    """A task event's fields, each checked (400 naming the field) before anything changes."""
    kind = next((t for t in TaskEventType if t.from_client and t.value == body.get("type")), None)
    if kind is None:  # `done` is the appliance's own: a one-turn task's turn ended
        allowed = ", ".join(t.value for t in TaskEventType if t.from_client)
        raise RequestRefused(400, f"'type' must be one of {allowed}", "invalid_value", param="type")
    verified = body.get("verified")
    if verified is not None and not isinstance(verified, bool):
        raise RequestRefused(
            400, "'verified' must be true or false", "invalid_type", param="verified"
        )
    evidence = body.get("evidence")
    if evidence is not None and (
        not isinstance(evidence, str) or len(evidence) > MAX_EVIDENCE_CHARS
    ):
        raise RequestRefused(
            400,
            f"'evidence' must be a string of at most {MAX_EVIDENCE_CHARS} characters",
            "invalid_value",
            param="evidence",
        )
    tool_class = body.get("tool_class")
    cost = _number(body, "cost", at_most=MAX_TOOL_COST) or 0.0
    if cost and kind != TaskEventType.TOOL_FINISHED:
        raise RequestRefused(
            400,
            "'cost' is what a finished tool cost: only a tool_finished event carries it",
            "invalid_value",
            param="cost",
        )
    return TaskEventFields(
        kind=kind,
        verified=verified,
        evidence=evidence,
        tool_class=identifier(tool_class, "tool_class") if tool_class is not None else None,
        expected_s=_number(body, "expected_s"),
        cost=cost,
    )


def _number(
    body: dict[str, Any], name: str, *, positive: bool = False, at_most: float = math.inf
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    bad = isinstance(value, bool) or not isinstance(value, int | float)
    if bad or not math.isfinite(value) or value < 0 or (positive and value == 0) or value > at_most:
        what = "> 0" if positive else ">= 0"
        most = f" and <= {at_most:g}" if at_most < math.inf else ""
        raise RequestRefused(
            400, f"'{name}' must be a finite number {what}{most}", "invalid_value", param=name
        )
    return float(value)


def _count(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RequestRefused(400, f"'{name}' must be an integer >= 0", "invalid_value", param=name)
    return value
