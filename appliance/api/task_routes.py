"""The task routes: create a task, report its events, cancel it (with its open
descendants), read it as a tree. Each change is acknowledged by the ledger before the
client hears it is done."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from appliance.api.context import ApiContext, Guard
from appliance.api.errors import ApiError
from appliance.api.requests import agent_headers, parse_json_body
from appliance.domain.records import TaskEventType


class TaskRoutes:
    def __init__(self, ctx: ApiContext) -> None:
        self._ctx = ctx

    def routes(self, guarded: Guard) -> list[Route]:
        return [
            Route("/v1/tasks", guarded(self.create_task), methods=["POST"]),
            Route("/v1/tasks/{task_id}", guarded(self.get_task), methods=["GET"]),
            Route("/v1/tasks/{task_id}/events", guarded(self.task_event), methods=["POST"]),
            Route("/v1/tasks/{task_id}/cancel", guarded(self.cancel_task), methods=["POST"]),
        ]

    async def create_task(self, request: Request) -> Response:
        who = self._ctx.keys.caller(request.headers)
        body = parse_json_body(await request.body()) if await request.body() else {}
        client_id = body.get("task_id") or f"task-{uuid.uuid4().hex[:16]}"
        for name, kind in (("task_id", str), ("parent_task_id", str), ("task_class", str)):
            if body.get(name) is not None and not isinstance(body[name], kind):
                raise ApiError(400, f"'{name}' must be a string", "invalid_type", param=name)
        deadline = body.get("deadline_s")
        if deadline is not None and (not isinstance(deadline, int | float) or deadline <= 0):
            raise ApiError(
                400, "'deadline_s' must be a number > 0", "invalid_value", param="deadline_s"
            )
        max_children = body.get("max_children")
        if max_children is not None and (
            not isinstance(max_children, int) or isinstance(max_children, bool) or max_children < 0
        ):
            raise ApiError(
                400, "'max_children' must be an integer >= 0", "invalid_value", param="max_children"
            )
        parent_id = body.get("parent_task_id")
        if self._ctx.admission is not None:
            await self._ctx.admission.admit_task(
                who.tenant,
                self._ctx.tasks.key(who.tenant, client_id),
                parent=self._ctx.tasks.key(who.tenant, parent_id) if parent_id else None,
                max_children=max_children,
                deadline_s=deadline,
                priority=agent_headers(request.headers, {}).priority,
            )
        task = self._ctx.tasks.create(
            who.tenant,
            client_id,
            self._ctx.clock.now(),
            parent_id=parent_id,
            task_class=body.get("task_class"),
            deadline_s=deadline,
            budget=body.get("budget"),
            max_children=max_children,
        )
        await _written(task.written)
        return JSONResponse(
            {"task_id": client_id, "deadline_at": task.deadline_at, "status": task.status.value},
            status_code=201,
        )

    async def task_event(self, request: Request) -> Response:
        who = self._ctx.keys.caller(request.headers)
        body = parse_json_body(await request.body())
        try:
            kind = TaskEventType(body.get("type"))
        except ValueError:
            allowed = ", ".join(t.value for t in TaskEventType)
            raise ApiError(
                400, f"'type' must be one of {allowed}", "invalid_value", param="type"
            ) from None
        verified = body.get("verified")
        if verified is not None and not isinstance(verified, bool):
            raise ApiError(
                400, "'verified' must be true or false", "invalid_type", param="verified"
            )
        task = self._ctx.tasks.event(
            who.tenant,
            request.path_params["task_id"],
            kind,
            self._ctx.clock.now(),
            verified=verified,
            evidence=body.get("evidence"),
            tool_class=body.get("tool_class"),
            expected_s=body.get("expected_s"),
        )
        if self._ctx.admission is not None and kind.terminal_status is not None:
            self._ctx.admission.task_closed(task.key)
        await _written(task.written)
        return JSONResponse({"task_id": task.client_id, "status": task.status.value})

    async def cancel_task(self, request: Request) -> Response:
        who = self._ctx.keys.caller(request.headers)
        cancelled = self._ctx.tasks.cancel(
            who.tenant, request.path_params["task_id"], self._ctx.clock.now()
        )
        for task in cancelled:
            if self._ctx.admission is not None:
                self._ctx.admission.task_closed(task.key)
            await _written(task.written)
        return JSONResponse({"cancelled": [t.client_id for t in cancelled]})

    async def get_task(self, request: Request) -> Response:
        who = self._ctx.keys.caller(request.headers)
        task = self._ctx.tasks.get(who.tenant, request.path_params["task_id"])
        if task is None:
            raise ApiError(
                404, f"task {request.path_params['task_id']} not found", "task_not_found"
            )
        return JSONResponse(self._ctx.tasks.tree(task))


async def _written(fut: Any) -> None:
    """Waits for the ledger to acknowledge a change before the client hears it is done."""
    if fut is not None:
        await asyncio.wrap_future(fut)
