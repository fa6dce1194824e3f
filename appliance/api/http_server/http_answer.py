"""What the API server writes back: an ASGI app's answer as HTTP/1.1 bytes (framed by its
Content-Length, else chunked), and the server's own refusals, in the API's error JSON."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Protocol

import orjson

from appliance.api.errors import error_body

REASONS = {s.value: s.phrase.encode("ascii") for s in HTTPStatus}


def status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status, b""))


def refusal_bytes(status: int, code: str, message: str) -> bytes:
    """A whole answer refusing the request, after which the connection closes: the same
    error JSON as the app's refusals (a client parses one shape, whoever refused)."""
    body = orjson.dumps(error_body(status, message, code))
    head = b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
    return status_line(status) + head % len(body) + body


class AnswerSink(Protocol):
    """The connection an answer is written to."""

    disconnected: bool

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def reject(self, status: int, code: str, message: str) -> None: ...


class AnswerWriter:
    """The ASGI `send` of one request: the head goes out with the first body piece."""

    def __init__(self, conn: AnswerSink, head_only: bool) -> None:
        self._conn = conn
        self._head_only = head_only
        self._chunked = False
        self._head = b""
        self.started = False
        self.finished = False

    async def send(self, message: dict[str, Any]) -> None:
        if self._conn.disconnected:
            raise ConnectionResetError("the client disconnected")
        kind = message["type"]
        if kind == "http.response.start":
            self._start(message)
        elif kind == "http.response.body":
            self._body(message.get("body", b""), message.get("more_body", False))
            await self._conn.drain()

    def _start(self, message: dict[str, Any]) -> None:
        status = message["status"]
        lines = [status_line(status)]
        length = False
        for name, value in message.get("headers", ()):
            length = length or name.lower() == b"content-length"
            lines.append(b"%s: %s\r\n" % (name, value))
        if not length and status >= 200 and status not in (204, 304):
            self._chunked = True
            lines.append(b"transfer-encoding: chunked\r\n")
        lines.append(b"\r\n")
        self._head = b"".join(lines)
        self.started = True

    def _body(self, data: bytes, more: bool) -> None:
        out = []
        if self._head:
            out.append(self._head)
            self._head = b""
        if data and not self._head_only:
            out.append(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)
        if not more:
            if self._chunked and not self._head_only:
                out.append(b"0\r\n\r\n")
            self.finished = True
        if out:
            self._conn.write(b"".join(out))

    def error(self) -> None:
        """The app failed before its answer started: a 500, and the connection closes."""
        self._conn.reject(500, "internal", "internal error; see the appliance log")
