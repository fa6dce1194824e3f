"""An HTTP client for one outside endpoint (escalation): an OpenAI-compatible API over
http or https, behind the EngineClient protocol the turn's forwarding already speaks.

Model of the world: only what the caller passes leaves the box (the body and the headers it
names, its key among them); the endpoint may send nothing for `timeout_s` (no head, or no
next piece of a stream) before the request is closed and EngineTimedOut raised. It cannot be
reached: EngineUnavailable; it answers an error status: EngineRequestError with its status
and body. The connection pool is made on first use, inside the loop that uses it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson

from appliance.engines.errors import EngineRequestError, EngineTimedOut, EngineUnavailable

CONNECT_TIMEOUT_S = 10.0


class OutsideStream:
    """A streaming answer, status already checked: its body as it arrives."""

    def __init__(self, response: aiohttp.ClientResponse, where: str) -> None:
        self._response = response
        self._where = where
        self.status_code = response.status

    async def read(self) -> bytes:
        """The whole body."""
        try:
            return await self._response.read()
        except TimeoutError:
            raise EngineTimedOut(f"{self._where}: no answer in time") from None
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"{self._where}: {exc or type(exc).__name__}") from None

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for data in self._response.content.iter_any():
                yield data
        except TimeoutError:
            raise EngineTimedOut(f"{self._where}: no next piece of the stream") from None
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"{self._where}: {exc or type(exc).__name__}") from None


class OutsideHttp:
    """One outside endpoint's HTTP face. Safe to share between tasks of one event loop."""

    def __init__(self, base_url: str, *, timeout_s: float, max_connections: int = 64) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=min(CONNECT_TIMEOUT_S, timeout_s), sock_read=timeout_s
        )
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._max_connections)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def post(
        self, path: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
    ) -> bytes:
        """The answer's body as the endpoint sent it (raises for an error status)."""
        async with self.open_stream(path, body, headers=headers) as response:
            return await response.read()

    @asynccontextmanager
    async def open_stream(
        self, path: str, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[OutsideStream]:
        """The endpoint's answer with its status checked; leaving the context closes it."""
        sent = {"Content-Type": "application/json", **(headers or {})}
        url = self.base_url + path
        try:
            response = await self._http().post(url, data=orjson.dumps(dict(body)), headers=sent)
        except TimeoutError:
            raise EngineTimedOut(f"{url}: no answer in time") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise self._unavailable(path, exc) from None
        try:
            if response.status >= 400:
                text = (await response.read()).decode("utf-8", "replace")
                raise EngineRequestError(
                    f"{url} answered {response.status}: {text[:300]}",
                    http_status=response.status,
                    body=text,
                )
            yield OutsideStream(response, url)
        finally:
            response.close()

    def _unavailable(self, path: str, exc: BaseException) -> EngineUnavailable:
        reason = str(exc) or type(exc).__name__
        return EngineUnavailable(
            f"outside endpoint {self.base_url} unreachable for {path}: {reason}"
        )
