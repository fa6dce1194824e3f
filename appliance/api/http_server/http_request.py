"""One HTTP/1.1 request as the API server's parser collects it
(appliance/api/http_server/server.py): its head's fields once the head is whole, its body in the
pieces it arrived in."""

from __future__ import annotations

from urllib.parse import unquote

import httptools


class HttpRequest:
    __slots__ = (
        "body",
        "headers",
        "http_version",
        "keep_alive",
        "method",
        "path",
        "query",
        "raw_path",
        "received_at",
    )
    received_at: float
    """When the whole request had arrived (time.monotonic())."""

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []

    def read_head(self, parser: httptools.HttpRequestParser, raw_url: bytes) -> None:
        """The method, path, query, HTTP version and keep-alive of the whole head."""
        url = httptools.parse_url(raw_url)
        self.method = parser.get_method().decode("ascii")
        self.raw_path = url.path
        path = url.path.decode("latin-1")
        self.path = unquote(path) if "%" in path else path
        self.query = url.query or b""
        self.http_version = parser.get_http_version()
        self.keep_alive = parser.should_keep_alive()

    def declared_length(self) -> int:
        """The Content-Length the head declares (the parser has checked it is a number),
        else 0."""
        for name, value in self.headers:
            if name == b"content-length":
                return int(value) if value.strip().isdigit() else 0
        return 0
