"""An async HTTP client for one vLLM OpenAI-compatible server (started by us or not).

Model of the world: the appliance passes model requests through unchanged (the body is the
client's OpenAI request, plus vLLM extras such as `session_id` or `cache_salt`) and reads
the answer either whole or as Server-Sent Events, one `data: {json}` line per chunk ending
with `data: [DONE]`. Everything else it needs from a worker is read-only: `/health` (200, or
503 when the engine died), `/metrics` (parsed into a LoadSnapshot), `/tokenize` and
`/v1/models`. A worker that cannot be reached raises EngineUnavailable; one that answers
with an error status raises EngineRequestError carrying that status and body, so the API can
hand the client vLLM's own message. A model request on which the worker sends nothing for
`read_timeout_s` (`engine.request_timeout_s`: no head, or no next piece of its body) raises
EngineTimedOut, its connection closed, which aborts the request in vLLM; a stream that keeps
sending is never cut.

This is the router's hot path, so it is lean: model requests go over `http1`'s kept-alive
connections with orjson bodies; the probes use aiohttp. Both connection pools are made on
first use, inside the event loop that uses them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from appliance.domain.worker import UVICORN_KEEPALIVE_S, LoadSnapshot
from appliance.engines.clients.http1 import Http1Error, Http1Pool, Http1Response, Http1Timeout
from appliance.engines.clients.metrics import load_snapshot
from appliance.engines.errors import EngineRequestError, EngineTimedOut, EngineUnavailable

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 600.0
"""The default of `engine.request_timeout_s`: how long a worker may send nothing."""
PROBE_TIMEOUT_S = 5.0
SLEEP_TIMEOUT_S = 300.0
"""A sleep or wake moves the weights (tens of GB on a large model) between GPU and host."""
REUSE_MARGIN_S = 1.0
"""An idle connection is reused only this long before its server would close it."""
JSON_HEADERS = {"Content-Type": "application/json"}
_JSON_HEADER = (("Content-Type", "application/json"),)
_FAILURES = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class WorkerStream:
    """A worker's streaming answer, status already checked: its body as it arrives."""

    def __init__(self, response: Http1Response, base_url: str, path: str) -> None:
        self._response = response
        self._where = (base_url, path)
        self.status_code = response.status

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes in the pieces the socket delivers them (to relay unchanged);
        raises EngineTimedOut when the worker sends nothing for the read timeout."""
        try:
            async for data in self._response.chunks():
                yield data
        except Http1Timeout as exc:
            raise _timed_out(*self._where, exc) from None

    async def lines(self) -> AsyncIterator[str]:
        tail = b""
        async for data in self._response.chunks():
            *complete, tail = (tail + data).split(b"\n")
            for raw in complete:
                yield raw.decode().rstrip("\r")
        if tail:
            yield tail.decode().rstrip("\r")


class VllmClient:
    """One worker's HTTP face. Safe to share between tasks of one event loop."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        read_timeout_s: float = READ_TIMEOUT_S,
        max_connections: int = 256,
        server_keepalive_s: float = UVICORN_KEEPALIVE_S,
    ) -> None:
        """`server_keepalive_s`: how long the server keeps an idle connection open."""
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._max_connections = max_connections
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._reuse_s = max(0.5, server_keepalive_s - REUSE_MARGIN_S)
        self._session: aiohttp.ClientSession | None = None
        self._pool: Http1Pool | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # Idle connections are dropped before the server's keep-alive timeout: reusing
            # one it is closing fails a request.
            connector = aiohttp.TCPConnector(
                limit=self._max_connections, keepalive_timeout=self._reuse_s
            )
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, auto_decompress=False
            )
        return self._session

    def _models(self) -> Http1Pool:
        if self._pool is None:
            url = urlsplit(self.base_url)
            self._pool = Http1Pool(
                url.hostname or "127.0.0.1",
                url.port or 80,
                connect_timeout_s=self._connect_timeout_s,
                read_timeout_s=self._read_timeout_s,
                keepalive_s=self._reuse_s,
                max_idle=self._max_connections,
            )
        return self._pool

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> VllmClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- probes ---

    async def health(self, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
        """True when /health answers 200; False for any other answer or none."""
        try:
            async with self._http().get(
                self.base_url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as response:
                await response.read()
                return response.status == 200
        except _FAILURES:
            return False

    async def metrics_text(self, timeout_s: float = PROBE_TIMEOUT_S) -> str:
        return (await self._request("GET", "/metrics", timeout_s=timeout_s)).decode()

    async def load(self, timeout_s: float = PROBE_TIMEOUT_S) -> LoadSnapshot:
        # Stamped when asked: vLLM's gauges are as of its last step, before the answer
        # left, so a request that ended while the scrape was on its way is not load.
        asked_at = time.time()
        text = await self.metrics_text(timeout_s)
        return load_snapshot(text, now=asked_at, model_name=self.model)

    async def models(self) -> list[dict[str, Any]]:
        raw = await self._request("GET", "/v1/models", timeout_s=PROBE_TIMEOUT_S)
        try:
            cards = orjson.loads(raw)["data"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            cards = None
        if not isinstance(cards, list):
            raise EngineUnavailable(f"{self.base_url}/v1/models is not a model list")
        return [card for card in cards if isinstance(card, dict)]

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
        answer = orjson.loads(await self._request("POST", "/tokenize", body=body))
        return [int(t) for t in answer["tokens"]]

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
        return dict(orjson.loads(await self.post(path, body, headers)))

    async def post(
        self, path: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
    ) -> bytes:
        """The answer's body as the worker sent it (raises for an error status)."""
        response = await self._post(path, body, headers)
        try:
            raw = await response.read()
        except Http1Error as exc:
            raise self._unavailable(path, exc) from None
        finally:
            response.release()
        if response.status >= 400:
            raise _request_error(path, response.status, None, raw.decode("utf-8", "replace"))
        return raw

    async def _post(
        self, path: str, body: Mapping[str, Any], headers: Mapping[str, str] | None
    ) -> Http1Response:
        extra = (*_JSON_HEADER, *headers.items()) if headers else _JSON_HEADER
        try:
            return await self._models().request("POST", path, _dumps(body), extra)
        except Http1Error as exc:
            raise self._unavailable(path, exc) from None

    @asynccontextmanager
    async def open_stream(
        self, path: str, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[WorkerStream]:
        """The worker's streaming response with its status checked. Leaving the context
        before the body ended closes the connection, which cancels the request in vLLM."""
        response = await self._post(path, body, headers)
        try:
            if response.status >= 400:
                raise _request_error(path, response.status, None, await _text(response))
            yield WorkerStream(response, self.base_url, path)
        finally:
            response.release()  # closed, not reused, unless the body was read to its end

    async def stream(
        self, path: str, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Each SSE chunk of a streamed completion or chat completion, decoded."""
        body = {**body, "stream": True}
        async with self.open_stream(path, body, headers=headers) as response:
            try:
                async for line in response.lines():
                    chunk = parse_sse_line(line)
                    if chunk is not None:
                        yield chunk
            except _FAILURES as exc:
                raise self._unavailable(path, exc) from None

    # --- sleep mode (vLLM's dev endpoints: VLLM_SERVER_DEV_MODE=1) ---

    async def sleep(self, level: int, timeout_s: float = SLEEP_TIMEOUT_S) -> None:
        """`POST /sleep?level=n` (mode abort: requests in flight are aborted)."""
        await self._request("POST", f"/sleep?level={level}", timeout_s=timeout_s)

    async def wake_up(self, timeout_s: float = SLEEP_TIMEOUT_S) -> bool:
        """`POST /wake_up`; whether the worker says it is fully awake."""
        raw = await self._request("POST", "/wake_up", timeout_s=timeout_s)
        return bool(orjson.loads(raw).get("status") == "awake")

    async def is_sleeping(self, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
        raw = await self._request("GET", "/is_sleeping", timeout_s=timeout_s)
        return bool(orjson.loads(raw).get("is_sleeping"))

    async def reload_weights(self, timeout_s: float = SLEEP_TIMEOUT_S) -> None:
        """`POST /collective_rpc` reload_weights: after a level-2 wake the weights are
        allocated but their values are gone; this loads them from the model again."""
        body = {"method": "reload_weights"}
        await self._request("POST", "/collective_rpc", body=body, timeout_s=timeout_s)

    # --- plumbing ---

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> bytes:
        """The answer's body; raises for no answer or an error status."""
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None
        data = _dumps(body) if body is not None else None
        try:
            async with self._http().request(
                method,
                self.base_url + path,
                data=data,
                headers=_headers(headers) if data is not None else headers,
                timeout=timeout,
            ) as response:
                raw = await response.read()
        except _FAILURES as exc:
            raise self._unavailable(path, exc) from None
        if response.status >= 400:
            raise _request_error(
                path, response.status, response.reason, raw.decode("utf-8", "replace")
            )
        return raw

    def _unavailable(self, path: str, exc: BaseException) -> EngineUnavailable:
        if isinstance(exc, Http1Timeout):
            return _timed_out(self.base_url, path, exc)
        reason = str(exc) or type(exc).__name__
        return EngineUnavailable(f"vLLM at {self.base_url} unreachable for {path}: {reason}")


def _timed_out(base_url: str, path: str, exc: Http1Timeout) -> EngineTimedOut:
    return EngineTimedOut(f"worker at {base_url}: {exc} on {path}; the request is closed there")


def _dumps(body: Mapping[str, Any]) -> bytes:
    return orjson.dumps(body if isinstance(body, dict) else dict(body))


def _headers(extra: Mapping[str, str] | None) -> Mapping[str, str]:
    return {**JSON_HEADERS, **extra} if extra else JSON_HEADERS


async def _text(response: Http1Response) -> str:
    try:
        return (await response.read()).decode("utf-8", "replace")
    except Http1Error:
        return ""


def parse_sse_line(line: str) -> dict[str, Any] | None:
    """The JSON of one `data:` line; None for `[DONE]`, comments, blank and other fields."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    value = json.loads(data)
    return value if isinstance(value, dict) else None


def _request_error(path: str, status: int, reason: str | None, body: str) -> EngineRequestError:
    message = body
    try:
        payload = json.loads(body)
        error = payload.get("error", payload) if isinstance(payload, dict) else payload
        message = str(error.get("message", body)) if isinstance(error, dict) else str(error)
    except ValueError:
        pass
    lines = message.strip().splitlines()
    first = lines[0][:300] if lines else (reason or "")
    return EngineRequestError(
        f"vLLM {path} answered {status}: {first}", http_status=status, body=body
    )
