"""An async HTTP client for one vLLM OpenAI-compatible server (started by us or not).

Model of the world: the appliance passes model requests through unchanged (the body is the
client's OpenAI request, plus vLLM extras such as `session_id` or `cache_salt`) and reads
the answer either whole or as Server-Sent Events, one `data: {json}` line per chunk ending
with `data: [DONE]`. Everything else it needs from a worker is read-only: `/health` (200, or
503 when the engine died), `/metrics` (parsed into a LoadSnapshot), `/tokenize` and
`/v1/models`. A worker that cannot be reached raises EngineUnavailable; one that answers
with an error status raises EngineRequestError carrying that status and body, so the API can
hand the client vLLM's own message.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx

from appliance.domain.worker import LoadSnapshot
from appliance.engines.errors import EngineRequestError, EngineUnavailable
from appliance.engines.metrics import load_snapshot

DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=60.0, pool=30.0)
PROBE_TIMEOUT_S = 5.0
KEEPALIVE_S = 2.0


class VllmClient:
    """One worker's HTTP face. Safe to share between tasks of one event loop."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = 256,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        # Idle connections are dropped well before the server's keep-alive timeout (uvicorn's,
        # and so vLLM's, is 5 s): reusing one the server is closing fails the request.
        limits = httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=KEEPALIVE_S,
        )
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=timeout, transport=transport, limits=limits
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> VllmClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- probes ---

    async def health(self, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
        """True when /health answers 200; False for any other answer or none."""
        try:
            response = await self._http.get("/health", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def metrics_text(self, timeout_s: float = PROBE_TIMEOUT_S) -> str:
        response = await self._request("GET", "/metrics", timeout=timeout_s)
        return response.text

    async def load(self, timeout_s: float = PROBE_TIMEOUT_S) -> LoadSnapshot:
        text = await self.metrics_text(timeout_s)
        return load_snapshot(text, now=time.time(), model_name=self.model)

    async def models(self) -> list[dict[str, Any]]:
        response = await self._request("GET", "/v1/models", timeout=PROBE_TIMEOUT_S)
        return list(response.json().get("data", []))

    async def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool | None = None,
    ) -> list[int]:
        """Token ids of a prompt, or of chat messages rendered with the model's template."""
        if (prompt is None) == (messages is None):
            raise ValueError("tokenize needs exactly one of prompt or messages")
        body: dict[str, Any] = {"model": self.model} if self.model else {}
        if messages is not None:
            body.update(messages=messages, add_generation_prompt=add_generation_prompt)
        else:
            body["prompt"] = prompt
        if add_special_tokens is not None:
            body["add_special_tokens"] = add_special_tokens
        response = await self._request("POST", "/tokenize", json=body)
        return [int(t) for t in response.json()["tokens"]]

    # --- model requests ---

    async def completions(
        self, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        return await self.post_json("/v1/completions", body, headers)

    async def chat(
        self, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        return await self.post_json("/v1/chat/completions", body, headers)

    async def post_json(
        self, path: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        response = await self._request("POST", path, json=dict(body), headers=headers)
        return dict(response.json())

    @asynccontextmanager
    async def open_stream(
        self, path: str, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[httpx.Response]:
        """The worker's streaming response with its status checked; read `aiter_lines()` or
        `aiter_raw()` to pass the bytes through unchanged. Closing it cancels the request."""
        request = self._http.build_request("POST", path, json=dict(body), headers=headers)
        try:
            response = await self._http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise self._unavailable(path, exc) from None
        try:
            if response.status_code >= 400:
                await response.aread()
                raise _request_error(path, response)
            yield response
        finally:
            await response.aclose()

    async def stream(
        self, path: str, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Each SSE chunk of a streamed completion or chat completion, decoded."""
        body = {**body, "stream": True}
        async with self.open_stream(path, body, headers=headers) as response:
            try:
                async for line in response.aiter_lines():
                    chunk = parse_sse_line(line)
                    if chunk is not None:
                        yield chunk
            except httpx.HTTPError as exc:
                raise self._unavailable(path, exc) from None

    # --- plumbing ---

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise self._unavailable(path, exc) from None
        if response.status_code >= 400:
            raise _request_error(path, response)
        return response

    def _unavailable(self, path: str, exc: httpx.HTTPError) -> EngineUnavailable:
        reason = str(exc) or type(exc).__name__
        return EngineUnavailable(f"vLLM at {self.base_url} unreachable for {path}: {reason}")


def parse_sse_line(line: str) -> dict[str, Any] | None:
    """The JSON of one `data:` line; None for `[DONE]`, comments, blank and other fields."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    value = json.loads(data)
    return value if isinstance(value, dict) else None


def _request_error(path: str, response: httpx.Response) -> EngineRequestError:
    body = response.text
    message = body
    try:
        payload = response.json()
        error = payload.get("error", payload) if isinstance(payload, dict) else payload
        message = str(error.get("message", body)) if isinstance(error, dict) else str(error)
    except ValueError:
        pass
    lines = message.strip().splitlines()
    first = lines[0][:300] if lines else response.reason_phrase
    return EngineRequestError(
        f"vLLM {path} answered {response.status_code}: {first}",
        http_status=response.status_code,
        body=body,
    )
