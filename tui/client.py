"""The console's view of a running appliance: `GET /admin/v1/state` over HTTP, nothing else.

No Textual here. `StateClient` makes the requests and turns every failure into a
`ConsoleError` whose message is one line an operator can act on. `Poller` is the console's
one poll loop: fetch a snapshot, hand it over, sleep to the next tick (2 Hz by default);
after a failure, say so once per attempt and retry with a capped backoff until the
appliance answers again, then say that it is back. A refused key (401, 403) is said once,
with the data dir and the name of the key used (never the key) and how to fix it, and is
not retried: the same key would be refused again; the operator's `r` tries once more. The
sync functions at the bottom serve the terminal tables (`appliance status/sessions/...`).
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

from appliance.api.admin.schemas import (
    AdminStateView,
    ErrorBody,
    ReleaseResult,
    SessionDetail,
    convert_state,
    decode_state,
)

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


class KeyRefused(Refused):
    """The appliance refused the console's key (401, 403): retrying cannot help; `message`
    says which key it was and how to get one it takes."""


class BadPayload(ConsoleError):
    """The appliance answered 200 with a body that is not the schema's."""


@dataclass(frozen=True, slots=True)
class KeySource:
    """Where the console's key came from, to name it when the appliance refuses it: its name
    in a data dir's api-keys.toml, or given on the command line (`name` None). Never the
    key itself."""

    name: str | None = None
    data_dir: Path | None = None

    def refused(self, url: str, status: int, said: str) -> str:
        """What to tell the operator when the appliance at `url` refused the key."""
        by_key = (
            'one of its operator keys (--key "$(appliance keys show NAME --data-dir DIR)"; '
            "`appliance keys list --data-dir DIR` names them)"
        )
        if self.name is None or self.data_dir is None:
            used, fix = "the key given with --key", f"pass {by_key}"
        else:
            keys = self.data_dir / KEYS_FILE
            used = f'operator key "{self.name}" from {keys} (data dir {self.data_dir})'
            fix = f"pass the data dir the appliance runs on (--data-dir DIR), or {by_key}"
        if status == 403:
            why = "it is not an operator key"
            fix = f"create one (`appliance keys add NAME --admin --data-dir DIR`) and {fix}"
        else:
            why = f"the appliance at {url} does not know it (revoked, or another data dir's)"
        return f"{said}. Used {used}: {why}. To fix it, {fix}."


def default_data_dir() -> Path:
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env) if env else Path.home() / ".local/share/appliance"


def find_admin_key(data_dir: Path | None = None) -> str | None:
    """The first operator key in the data dir's api-keys.toml, or None (no file, no admin key,
    or a file that cannot be read)."""
    found = find_operator_key(data_dir)
    return found[1] if found is not None else None


def find_operator_key(data_dir: Path | None = None) -> tuple[str, str] | None:
    """(name, key) of the first operator key in the data dir's api-keys.toml, or None."""
    path = (data_dir or default_data_dir()) / KEYS_FILE
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None
    keys = data.get("keys", {})
    for name, entry in keys.items() if isinstance(keys, dict) else ():
        if isinstance(entry, dict) and entry.get("admin") is True:
            key = entry.get("key")
            if isinstance(key, str) and key:
                return str(name), key
    return None


def console_key(api_key: str | None, data_dir: Path | None) -> tuple[str, KeySource] | None:
    """The key given, else the data dir's first operator key, with where it came from; None
    when there is neither."""
    if api_key:
        return api_key, KeySource()
    found = find_operator_key(data_dir)
    if found is None:
        return None
    return found[1], KeySource(found[0], data_dir or default_data_dir())


def error_text(response: httpx.Response) -> str:
    """`404 Not Found: <the server's message>` from an OpenAI-style error body, else its text."""
    head = f"{response.status_code} {response.reason_phrase}".strip()
    try:
        message = msgspec.json.decode(response.content, type=ErrorBody).error.message
    except msgspec.DecodeError:
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
        key_source: KeySource | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.key_source = key_source
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
            raise refusal(self.url, response, self.key_source)
        return response

    async def state(self) -> AdminStateView:
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
            return msgspec.json.decode(response.content or b"{}", type=ReleaseResult)
        except msgspec.DecodeError:
            return ReleaseResult(session_id=session_id, tenant=tenant)

    async def session_detail(
        self, session_id: str, tenant: str | None = None, turns: int | None = None
    ) -> SessionDetail:
        """`GET /admin/v1/sessions/{id}?tenant=T[&turns=N]`: the session, its residency, its
        newest turns (the server's default number, or `turns`)."""
        path = f"/admin/v1/sessions/{quote(session_id, safe='')}"
        params = _tenant(tenant) or {}
        if turns is not None:
            params["turns"] = str(turns)
        response = await self._request("GET", path, params or None)
        try:
            return msgspec.json.decode(response.content, type=SessionDetail)
        except msgspec.DecodeError as exc:
            raise BadPayload(f"{self.url}{path}: unexpected reply ({exc})") from None

    async def aclose(self) -> None:
        await self._http.aclose()


def refusal(url: str, response: httpx.Response, key: KeySource | None) -> Refused:
    """The error for an answer >= 400: a refused key (401, 403) says which key it was (when
    `key` says where it came from) and how to fix it."""
    status, said = response.status_code, error_text(response)
    if status not in (401, 403):
        return Refused(said, status=status)
    message = key.refused(url, status, said) if key is not None else said
    return KeyRefused(message, status=status)


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
    retrying: bool = True
    """False when retrying cannot help (the appliance refused the key): the console waits
    for the operator's `r`."""


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

    async def _sleep(self, seconds: float | None) -> None:
        """Until `seconds` have passed or `wake()` is called (None: until then only)."""
        self._wake.clear()
        if seconds is not None and seconds <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=seconds)

    async def run(
        self,
        on_state: Callable[[AdminStateView], object],
        on_lost: Callable[[Lost], object],
        on_restored: Callable[[], object],
    ) -> None:
        down_since: float | None = None
        while True:
            started = self._clock()
            try:
                state = await self.client.state()
            except KeyRefused as exc:  # the same key is refused again: said once, not retried
                down_since = down_since if down_since is not None else time.time()
                self.backoff.reset()
                on_lost(Lost(exc.message, 1, 0.0, down_since, retrying=False))
                await self._sleep(None)
                continue
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


def fetch_state(
    url: str, api_key: str | None, *, timeout_s: float = 5.0, key_source: KeySource | None = None
) -> dict[str, Any]:
    """One snapshot as plain JSON data, checked against the schema (for the terminal tables
    and `--json`). Raises ConsoleError with a one-line message."""
    base = url.rstrip("/")
    try:
        response = httpx.get(base + STATE_PATH, headers=_headers(api_key), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise _unreachable(base, exc) from None
    if response.status_code >= 400:
        raise refusal(base, response, key_source)
    try:
        data: dict[str, Any] = response.json()
        convert_state(data)
    except (ValueError, msgspec.ValidationError) as exc:
        raise BadPayload(f"{base}{STATE_PATH} sent an unexpected snapshot: {exc}") from None
    return data


def resolve_api_key(api_key: str | None, data_dir: Path | None) -> str | None:
    """The key given, else the data dir's first operator key, else None."""
    return api_key or find_admin_key(data_dir)
