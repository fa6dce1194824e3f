"""The benchmark's view of a running appliance: its HTTP API, nothing else.

Model of the world: a model call is a streaming chat completion through the unchanged
`openai` client (no retries, so each call is exactly one attempt in the ledger) with the
agent headers; tasks are created, told about tool runs and outcomes, and cancelled through
`/v1/tasks`. Every failure of a call becomes a `AgentStepResult` or a False answer with one line
saying why, never an exception that stops the run; only the preflight (`probe`) raises,
because without a reachable appliance and a valid key there is nothing to measure.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote

import httpx
import openai

from appliance.bench.report import AgentStepResult
from appliance.domain.errors import ApplianceError


class BenchError(ApplianceError):
    """The benchmark cannot run: no appliance at the URL (exit 1), or it refused the key."""

    code = "bench_error"
    exit_code = 1


class BadInput(BenchError):
    """The appliance refused the key, or an option or file given to the benchmark is wrong."""

    code = "bench_bad_input"
    exit_code = 2


@dataclass(frozen=True, slots=True)
class ModelCard:
    name: str
    max_model_len: int | None


@dataclass(frozen=True, slots=True)
class TaskAnswer:
    ok: bool
    status: int
    error: str | None = None
    retry_after_s: float | None = None


def _reason(url: str, exc: Exception) -> str:
    cause: BaseException | None = exc
    while cause is not None:  # httpx hides the socket's own words under its summary
        if isinstance(cause, OSError) and cause.errno:
            return f"cannot reach {url}: {os.strerror(cause.errno).lower()}"
        cause = cause.__cause__ or cause.__context__
    if isinstance(exc, httpx.TimeoutException):
        return f"cannot reach {url}: no answer in time"
    return f"cannot reach {url}: {exc or type(exc).__name__}"


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
        message = body["error"]["message"] if isinstance(body, dict) else str(body)
    except (ValueError, KeyError, TypeError):
        message = response.text.strip().splitlines()[0] if response.text.strip() else ""
    return f"{response.status_code} {message}".strip()[:300]


async def probe(url: str, api_key: str, *, tenant: str, timeout_s: float = 10.0) -> ModelCard:
    """The served model; BenchError when the appliance is not there or refuses the key."""
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            response = await http.get(
                f"{url}/v1/models", headers={"Authorization": f"Bearer {api_key}"}
            )
    except httpx.HTTPError as exc:
        raise BenchError(_reason(url, exc)) from None
    if response.status_code in (401, 403):
        raise BadInput(
            f"{url} refused the API key for tenant '{tenant}' ({_error_message(response)}); "
            "pass --api-key or check `appliance keys list`"
        )
    if response.status_code != 200:
        raise BenchError(f"{url}/v1/models answered {_error_message(response)}")
    try:
        card = response.json()["data"][0]
        limit = card.get("max_model_len")
        return ModelCard(str(card["id"]), int(limit) if limit else None)
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"{url}/v1/models is not an OpenAI model list") from None


class ApplianceClient:
    """One tenant's connection: the openai client for model calls, httpx for tasks."""

    def __init__(self, url: str, api_key: str, *, model: str, timeout_s: float = 600.0) -> None:
        self.url = url
        self.model = model
        self._ai = openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=timeout_s
        )
        self._http = httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60.0
        )

    async def aclose(self) -> None:
        await self._ai.close()
        await self._http.aclose()

    async def _post(self, path: str, body: Mapping[str, Any]) -> TaskAnswer:
        try:
            response = await self._http.post(path, json=dict(body))
        except httpx.HTTPError as exc:
            return TaskAnswer(False, 0, _reason(self.url, exc))
        if response.status_code >= 400:
            retry = response.headers.get("retry-after")
            try:
                retry_s = float(retry) if retry else None
            except ValueError:
                retry_s = None
            return TaskAnswer(False, response.status_code, _error_message(response), retry_s)
        return TaskAnswer(True, response.status_code)

    async def create_task(
        self,
        task_id: str,
        *,
        parent_id: str | None,
        task_class: str,
        deadline_s: float | None,
    ) -> TaskAnswer:
        body: dict[str, Any] = {"task_id": task_id, "task_class": task_class}
        if parent_id is not None:
            body["parent_task_id"] = parent_id
        if deadline_s is not None:
            body["deadline_s"] = deadline_s
        return await self._post("/v1/tasks", body)

    async def event(self, task_id: str, kind: str, **fields: Any) -> TaskAnswer:
        body = {"type": kind, **{k: v for k, v in fields.items() if v is not None}}
        return await self._post(f"/v1/tasks/{quote(task_id, safe='')}/events", body)

    async def cancel(self, task_id: str) -> TaskAnswer:
        return await self._post(f"/v1/tasks/{quote(task_id, safe='')}/cancel", {})

    async def metrics(self) -> str | None:
        """The appliance's `/metrics` text; None when it does not answer."""
        try:
            response = await self._http.get("/metrics")
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    async def step(
        self,
        task_id: str,
        messages: list[dict[str, str]],
        *,
        headers: Mapping[str, str],
        output_tokens: int = 1,
        options: Mapping[str, Any] | None = None,
    ) -> tuple[AgentStepResult, str]:
        """One streamed model call: its result and the generated text. `options`: the
        request's fields (max_tokens, tools, extra_body), else `output_tokens` of text."""
        start = time.perf_counter()
        ttft_s: float | None = None
        text: list[str] = []
        usage, finish = None, None
        fields = options or {"max_tokens": output_tokens, "extra_body": {"ignore_eos": True}}
        create = self._ai.chat.completions.with_streaming_response.create
        try:
            async with create(  # type: ignore[call-overload]
                model=self.model,
                messages=messages,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers=dict(headers),
                **fields,
            ) as response:
                worker = response.headers.get("x-appliance-worker")
                async for chunk in await response.parse():
                    if chunk.choices and ttft_s is None:  # the role, with the first token
                        ttft_s = time.perf_counter() - start
                    for choice in chunk.choices:
                        if choice.delta.content:
                            text.append(choice.delta.content)
                        finish = choice.finish_reason or finish
                    if chunk.usage is not None:
                        usage = chunk.usage
        except openai.APIStatusError as exc:
            failed = _failed(task_id, start, f"{exc.status_code} {_openai_message(exc)}")
            return replace(failed, rejected=exc.status_code == 429), ""
        except openai.APIError as exc:
            return _failed(task_id, start, _openai_message(exc)), ""
        e2e_s = time.perf_counter() - start
        if usage is None:
            return _failed(task_id, start, "the stream ended without usage"), ""
        details = usage.prompt_tokens_details
        result = AgentStepResult(
            task_id=task_id,
            ok=True,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=(details.cached_tokens or 0) if details else 0,
            output_tokens=usage.completion_tokens,
            ttft_s=ttft_s,
            e2e_s=e2e_s,
            worker=worker,
            finish_reason=finish,
        )
        return result, "".join(text)


def _failed(task_id: str, start: float, error: str) -> AgentStepResult:
    return AgentStepResult(task_id, False, e2e_s=time.perf_counter() - start, error=error[:300])


def _openai_message(exc: openai.APIError) -> str:
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return str(inner["message"])
        if isinstance(body.get("message"), str):
            return str(body["message"])
    return str(exc.message or type(exc).__name__)
