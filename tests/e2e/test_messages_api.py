"""The Anthropic Messages API through `appliance up`, with the `anthropic` SDK unchanged but
for its base URL and key, on the simulated engine and on real vLLM (CPU build): a message
and its stream, a second turn on the worker holding its prefix that reads it from the
cache, usage as the ledger records it, and refusals in the API's own error shape."""

from __future__ import annotations

import sqlite3
import time
from contextlib import closing

import anthropic
import httpx
import pytest

from tests.e2e.conftest import RunningAppliance
from tests.e2e.test_up import text

pytestmark = pytest.mark.e2e


def sdk(app: RunningAppliance) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=app.url, api_key=app.keys["alice"], max_retries=0)


def test_a_conversation_of_messages_stays_on_its_worker_and_reads_its_prefix(
    appliance_up: RunningAppliance,
) -> None:
    app, client = appliance_up, sdk(appliance_up)
    system = text(201, app.words(300))
    history: list[anthropic.types.MessageParam] = [
        {"role": "user", "content": text(202, app.words(40))}
    ]
    raw = client.messages.with_raw_response.create(
        model=app.model, max_tokens=8, system=system, messages=history
    )
    first = raw.parse()
    assert (first.type, first.role, first.content[0].type) == ("message", "assistant", "text")
    assert first.stop_reason == "max_tokens" and first.usage.output_tokens == 8
    worker = raw.headers["x-appliance-worker"]
    history += [
        {"role": "assistant", "content": first.content[0].text},  # type: ignore[union-attr]
        {"role": "user", "content": text(203, app.words(20))},
    ]
    with client.messages.stream(
        model=app.model, max_tokens=6, system=system, messages=history
    ) as stream:
        streamed = "".join(stream.text_stream)
        second = stream.get_final_message()
    assert second.content[0].text == streamed  # type: ignore[union-attr]
    usage = second.usage
    assert usage.cache_read_input_tokens and usage.cache_read_input_tokens > usage.input_tokens
    deadline = time.monotonic() + 5  # the ledger commits a moment after the answer
    while len(rows := ledger_turns_by_prefix(app)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r[0] for r in rows] == [worker, worker], rows  # the second on the first's worker
    prompt, cached, output = rows[-1][1:]
    assert (prompt, cached, output) == (
        usage.input_tokens + usage.cache_read_input_tokens,
        usage.cache_read_input_tokens,
        usage.output_tokens,
    )


def ledger_turns_by_prefix(app: RunningAppliance) -> list[tuple[str, int, int, int]]:
    """The turns of sessions the appliance found by their prefix (the client names none)."""
    with closing(sqlite3.connect(app.ledger)) as db:
        return db.execute(
            "SELECT worker, prompt_tokens, cached_tokens, output_tokens FROM turns"
            " WHERE session_id LIKE 'chain-%' AND outcome = 'ok' ORDER BY started_at"
        ).fetchall()


def test_refusals_come_in_the_messages_apis_shape(appliance_up: RunningAppliance) -> None:
    app = appliance_up
    url = f"{app.url}/v1/messages"
    key = {"x-api-key": app.keys["alice"]}
    no_max = {"model": app.model, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(url, json=no_max, headers=key, timeout=30)
    assert r.status_code == 400
    assert r.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "'max_tokens' is required: an integer >= 1",
        },
    }
    r = httpx.post(url, json={**no_max, "max_tokens": 4}, headers={"x-api-key": "nope"})
    assert (r.status_code, r.json()["error"]["type"]) == (401, "authentication_error")
    with pytest.raises(anthropic.BadRequestError):
        sdk(app).messages.create(
            model=app.model,
            max_tokens=4,
            messages=[{"role": "robot", "content": "x"}],  # type: ignore[list-item]
        )
