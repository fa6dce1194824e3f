"""The router finds a stream's `usage` in the bytes it relays, however the socket cut them."""

from __future__ import annotations

import json

import pytest

from appliance.services.turns.forwarder import UsageScanner

USAGE = {"prompt_tokens": 9, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}}
STREAM = (
    b": keep-alive\n\n"
    + b'data: {"choices": [{"index": 0, "delta": {"content": "usage"}}]}\n\n'
    + f"data: {json.dumps({'choices': [], 'usage': USAGE})}\n\n".encode()
    + b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("piece", [1, 2, 7, 33, len(STREAM)])
def test_usage_is_found_whatever_the_cut(piece: int) -> None:
    scanner = UsageScanner()
    for i in range(0, len(STREAM), piece):
        scanner.feed(STREAM[i : i + piece])
    assert scanner.last == USAGE


def test_the_last_usage_wins_and_null_or_broken_lines_are_ignored() -> None:
    scanner = UsageScanner()
    scanner.feed(
        b'data: {"usage": {"prompt_tokens": 1}}\n\ndata: {"usage": {"prompt_tokens": 2}}\n'
    )
    scanner.feed(b'data: {"usage": null}\n\ndata: {"usage": {broken\n\n')
    assert scanner.last == {"prompt_tokens": 2}


def test_a_line_without_its_newline_is_not_read_yet() -> None:
    scanner = UsageScanner()
    scanner.feed(b'data: {"usage": {"prompt_tokens": 1}}')
    assert scanner.last is None
    scanner.feed(b"\n\n")
    assert scanner.last == {"prompt_tokens": 1}
