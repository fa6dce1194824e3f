"""`Idempotency-Key` on the task routes: a client that retries a change after a timeout gets
the first answer, not a second change.

A key names one request of one tenant: the same key with the same method, path and body
returns the first successful answer again (with `Idempotent-Replayed: true`); with a
different request it is a 422 (`idempotency_key_reused`); while the first is still being
served, a 409 (`idempotency_key_in_use`), so the client retries later. Only successes are
kept: a refused or failed request changed nothing, and its retry is judged afresh.

Kept in memory for `TTL_S`, at most `MAX_KEYS` (least recently stored dropped first). After
a restart the routes' own rules still hold for a retry: a creation with the same fields
returns the task, a closing event already applied changes nothing, a cancel cancels what
is still open.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from appliance.api.errors import RequestRefused
from appliance.api.turns.requests import identifier

HEADER = "idempotency-key"
TTL_S = 24 * 3600.0
"""A day: longer than any client's retry loop."""
MAX_KEYS = 10_000
"""About 1 KiB each at most (a task route's answer is small): 10 MiB."""

Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True, slots=True)
class _Answer:
    fingerprint: bytes
    stored_at: float
    status: int = 0
    """0 while the first request is being served."""
    body: bytes = b""
    media_type: str | None = None


class IdempotencyKeys:
    def __init__(
        self,
        tenant_of: Callable[[Request], str],
        *,
        ttl_s: float = TTL_S,
        max_keys: int = MAX_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tenant_of = tenant_of
        self._ttl_s = ttl_s
        self._max_keys = max_keys
        self._clock = clock
        self._answers: OrderedDict[tuple[str, str], _Answer] = OrderedDict()

    def __call__(self, handler: Handler) -> Handler:
        """`handler`, answering a repeated `Idempotency-Key` as the module says."""

        async def keyed(request: Request) -> Response:
            raw = request.headers.get(HEADER)
            if raw is None:
                return await handler(request)
            key = (self._tenant_of(request), identifier(raw, HEADER))
            fingerprint = await _fingerprint(request)
            known = self._known(key)
            if known is not None:
                return _repeat(known, fingerprint)
            self._store(key, _Answer(fingerprint, self._clock()))
            try:
                response = await handler(request)
            except BaseException:
                self._answers.pop(key, None)
                raise
            if 200 <= response.status_code < 300:
                self._store(
                    key,
                    _Answer(
                        fingerprint,
                        self._clock(),
                        response.status_code,
                        bytes(response.body),
                        response.media_type,
                    ),
                )
            else:
                self._answers.pop(key, None)
            return response

        return keyed

    def _known(self, key: tuple[str, str]) -> _Answer | None:
        answer = self._answers.get(key)
        if answer is not None and self._clock() - answer.stored_at > self._ttl_s:
            del self._answers[key]
            return None
        return answer

    def _store(self, key: tuple[str, str], answer: _Answer) -> None:
        self._answers[key] = answer
        self._answers.move_to_end(key)
        while len(self._answers) > self._max_keys:
            self._answers.popitem(last=False)


async def _fingerprint(request: Request) -> bytes:
    digest = hashlib.sha256(f"{request.method} {request.url.path}\n".encode())
    digest.update(await request.body())
    return digest.digest()


def _repeat(known: _Answer, fingerprint: bytes) -> Response:
    if known.fingerprint != fingerprint:
        raise RequestRefused(
            422,
            "this Idempotency-Key was used for a different request",
            "idempotency_key_reused",
            param=HEADER,
        )
    if known.status == 0:
        raise RequestRefused(
            409,
            "the first request with this Idempotency-Key is still being served; retry",
            "idempotency_key_in_use",
            param=HEADER,
        )
    headers = {"Idempotent-Replayed": "true"}
    return Response(known.body, known.status, headers=headers, media_type=known.media_type)
