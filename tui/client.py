"""The console's view of a running appliance: `GET /admin/v1/state` over HTTP, nothing else.

No Textual here. `StateClient` makes the requests and turns every failure into a
`ConsoleError` whose message is one line an operator can act on. `Poller` is the console's
one poll loop: fetch a snapshot, hand it over, sleep to the next tick (2 Hz by default);
after a failure, say so once per attempt and retry with a capped backoff until the
appliance answers again, then say that it is back. The sync functions at the bottom serve the
terminal tables (`appliance status/sessions/tasks/events`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import msgspec
from pydantic import ValidationError

from appliance.api.schemas import AdminStateView, ErrorBody, ReleaseResult, SessionDetail
from tui.state import AdminState, decode_state

STATE_PATH = "/admin/v1/state"
DATA_DIR_ENV = "APPLIANCE_DATA_DIR"
KEYS_FILE = "api-keys.toml"


class ConsoleError(Exception):
    """A failure the console shows as one line."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class Unreachable(ConsoleError):
    """No HTTP answer: refused, reset, timed out."""


class Refused(ConsoleError):
    """The appliance answered with an error status; `message` carries its own words."""


class BadPayload(ConsoleError):
    """The appliance answered 200 with a body that is not the schema's."""


def default_data_dir() -> Path:
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env) if env else Path.home() / ".local/share/appliance"


def find_admin_key(data_dir: Path | None = None) -> str | None:
    """The first operator key in the data dir's api-keys.toml, or None (no file, no admin key,
    or a file that cannot be read)."""
    path = (data_dir or default_data_dir()) / KEYS_FILE
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None
    keys = data.get("keys", {})
    for entry in keys.values() if isinstance(keys, dict) else ():
        if isinstance(entry, dict) and entry.get("admin") is True:
            key = entry.get("key")
            if isinstance(key, str) and key:
                return key
    return None


def error_text(response: httpx.Response) -> str:
    """`404 Not Found: <the server's message>` from an OpenAI-style error body, else its text."""
    head = f"{response.status_code} {response.reason_phrase}".strip()
    try:
        message = ErrorBody.model_validate_json(response.content).error.message
    except ValidationError:
        message = response.text.strip().splitlines()[0] if response.text.strip() else ""
    message = message[:300]
    if not message or message.lower() == response.reason_phrase.lower():
        return head
    return f"{head}: {message}"


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _unreachable(url: str, exc: httpx.HTTPError) -> Unreachable:
    reason = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        reason = "no answer in time"
    cause: BaseException | None = exc
    while cause is not None:  # httpx hides the socket's own words under its summary
        if isinstance(cause, OSError) and (cause.errno or cause.strerror):
            reason = (os.strerror(cause.errno) if cause.errno else str(cause.strerror)).lower()
            break
        cause = cause.__cause__ or cause.__context__
    return Unreachable(f"cannot reach {url}: {reason}")


class StateClient:
    def __init__(
        self,
        url: str,
        api_key: str | None,
        *,
        timeout_s: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers=_headers(api_key),
            timeout=timeout_s,
            transport=transport,
        )

    async def _request(
        self, method: str, path: str, params: dict[str, str] | None = None
    ) -> httpx.Response:
        try:
            response = await self._http.request(method, path, params=params)
        except httpx.HTTPError as exc:
            raise _unreachable(self.url, exc) from None
        if response.status_code >= 400:
            raise Refused(error_text(response), status=response.status_code)
        return response

    async def state(self) -> AdminState:
        response = await self._request("GET", STATE_PATH)
        try:
            return decode_state(response.content)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise BadPayload(
                f"{self.url}{STATE_PATH} sent a snapshot the console does not understand "
                f"({exc}); are the console and the appliance the same version?"
            ) from None

    async def release_session(self, session_id: str, tenant: str | None = None) -> ReleaseResult:
        """`POST /admin/v1/sessions/{id}/release?tenant=T` (session ids are per tenant)."""
        path = f"/admin/v1/sessions/{quote(session_id, safe='')}/release"
        response = await self._request("POST", path, _tenant(tenant))
        try:
            return ReleaseResult.model_validate_json(response.content or b"{}")
        except ValidationError:
            return ReleaseResult(session_id=session_id, tenant=tenant)

    async def session_detail(self, session_id: str, tenant: str | None = None) -> SessionDetail:
        """`GET /admin/v1/sessions/{id}?tenant=T`: the session, its residency, its turns."""
        path = f"/admin/v1/sessions/{quote(session_id, safe='')}"
        response = await self._request("GET", path, _tenant(tenant))
        try:
            return SessionDetail.model_validate_json(response.content)
        except ValidationError as exc:
            raise BadPayload(
                f"{self.url}{path}: unexpected reply ({exc.error_count()} errors)"
            ) from None

    async def aclose(self) -> None:
        await self._http.aclose()


def _tenant(tenant: str | None) -> dict[str, str] | None:
    return {"tenant": tenant} if tenant is not None else None


class Backoff:
    """Retry delays: first_s, doubling, capped at max_s; `reset()` after a success."""

    def __init__(self, first_s: float = 0.5, max_s: float = 5.0) -> None:
        self.first_s, self.max_s = first_s, max_s
        self.attempt = 0

    def next_delay(self) -> float:
        self.attempt += 1
        return float(min(self.max_s, self.first_s * 2.0 ** (self.attempt - 1)))

    def reset(self) -> None:
        self.attempt = 0


@dataclass(frozen=True, slots=True)
class Lost:
    """The appliance did not answer (or refused): what went wrong and when it is tried again."""

    message: str
    attempt: int
    retry_in_s: float
    since: float
    """Wall time of the first failure of this outage."""


class Poller:
    """The one poll loop. Callbacks run on the loop's task; they must not block."""

    def __init__(
        self,
        client: StateClient,
        *,
        interval_s: float = 0.5,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.interval_s = interval_s
        self.backoff = backoff or Backoff()
        self._clock = clock
        self._wake = asyncio.Event()
        self.polls = 0

    def wake(self) -> None:
        """Fetch now instead of at the next tick (or the next retry)."""
        self._wake.set()

    async def _sleep(self, seconds: float) -> None:
        self._wake.clear()
        if seconds <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=seconds)

    async def run(
        self,
        on_state: Callable[[AdminState], object],
        on_lost: Callable[[Lost], object],
        on_restored: Callable[[], object],
    ) -> None:
        down_since: float | None = None
        while True:
            started = self._clock()
            try:
                state = await self.client.state()
            except ConsoleError as exc:
                down_since = down_since if down_since is not None else time.time()
                delay = self.backoff.next_delay()
                on_lost(Lost(exc.message, self.backoff.attempt, delay, down_since))
                await self._sleep(delay)
                continue
            self.polls += 1
            if down_since is not None:
                down_since = None
                on_restored()
            self.backoff.reset()
            on_state(state)
            await self._sleep(self.interval_s - (self._clock() - started))


def fetch_state(url: str, api_key: str | None, *, timeout_s: float = 5.0) -> dict[str, Any]:
    """One snapshot as plain JSON data, checked against the schema (for the terminal tables
    and `--json`). Raises ConsoleError with a one-line message."""
    base = url.rstrip("/")
    try:
        response = httpx.get(base + STATE_PATH, headers=_headers(api_key), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise _unreachable(base, exc) from None
    if response.status_code >= 400:
        raise Refused(error_text(response), status=response.status_code)
    try:
        data: dict[str, Any] = response.json()
        AdminStateView.model_validate(data)
    except (ValueError, ValidationError) as exc:
        raise BadPayload(f"{base}{STATE_PATH} sent an unexpected snapshot: {exc}") from None
    return data


def resolve_api_key(api_key: str | None, data_dir: Path | None) -> str | None:
    """The key given, else the data dir's first operator key, else None."""
    return api_key or find_admin_key(data_dir)
