"""Harnesses and benchmark tools unchanged against `appliance up --engine sim`: an over-long
prompt is 400 in each API's own shape and words; Claude model names are served through
`api.model_aliases` (the Anthropic SDK as Claude Code would use it, its base URL the
appliance); `server.auth: none` takes the key `EMPTY` or none on loopback (as
kv-cache-tester's trace_replay_tester.py sends it) and is refused on any other address; a
second appliance on the machine needs only its own `--port`, and a port conflict names
every port in conflict at once."""

from __future__ import annotations

import json
import os
import re
import socket
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, closing
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from appliance.config.settings import PORT_OFFSETS
from tests.e2e.conftest import BIN
from tests.e2e.test_up import text
from tests.ports import free_port, free_port_block, port_is_free
from tests.running import Started, add_key, appliance_process

pytestmark = pytest.mark.e2e
LIMIT = 4096
ALIASES = {"claude-sonnet-4-5": "sim", "claude-haiku-4-5": "sim"}
HELLO = {"model": "sim", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def aliased(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Started, str]]:
    """One simulated worker, a 4096-token window, two Claude names mapped to `sim`."""
    data_dir = tmp_path_factory.mktemp("comfort")
    key = add_key(data_dir, "alice")
    env = {
        "APPLIANCE_ENGINE__MAX_MODEL_LEN": str(LIMIT),
        "APPLIANCE_API__MODEL_ALIASES": json.dumps(ALIASES),
    }
    with appliance_process(data_dir, workers=1, env=env) as up:
        yield up, key


def turns_of(ledger: Path, session: str) -> list[tuple[str, str]]:
    with closing(sqlite3.connect(ledger)) as db:
        return db.execute(
            "SELECT tenant, outcome FROM turns WHERE session_id = ?", (session,)
        ).fetchall()


def test_an_over_long_prompt_is_400_in_each_apis_own_shape(
    aliased: tuple[Started, str],
) -> None:
    up, key = aliased
    long = text(11, 6000)
    bodies = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": long}]},
        "/v1/completions": {"prompt": long},
        "/v1/responses": {"input": long},
        "/v1/messages": {"messages": [{"role": "user", "content": long}]},
    }
    headers = {"Authorization": f"Bearer {key}", "X-Session-ID": "too-long"}
    with httpx.Client(base_url=up.url, headers=headers, timeout=60) as http:
        answers = {
            path: http.post(path, json={"model": "sim", "max_tokens": 8, **body})
            for path, body in bodies.items()
        }
    for path, answer in answers.items():
        assert answer.status_code == 400, (path, answer.text)
        if path == "/v1/messages":
            error = answer.json()
            assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
            assert re.fullmatch(
                rf"prompt is too long: \d+ tokens > {LIMIT} maximum", error["error"]["message"]
            )
            continue
        error = answer.json()["error"]
        assert (error["type"], error["code"]) == ("BadRequestError", "context_length_exceeded")
        assert error["message"].startswith(f"This model's maximum context length is {LIMIT}")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        openai.OpenAI(base_url=f"{up.url}/v1", api_key=key, max_retries=0).chat.completions.create(
            model="sim", messages=[{"role": "user", "content": long}]
        )
    client = anthropic.Anthropic(base_url=up.url, api_key=key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        client.messages.create(
            model="claude-sonnet-4-5", max_tokens=8, messages=[{"role": "user", "content": long}]
        )
    assert turns_of(up.log.parent / "ledger.db", "too-long") == []  # refused before any worker


def test_an_answer_longer_than_the_window_leaves_is_shortened_as_vllm_does(
    aliased: tuple[Started, str],
) -> None:
    """A prompt that fits, asking for more output than the window leaves: served (vLLM 0.32
    shortens `max_tokens`), on the OpenAI routes; Anthropic's API refuses it."""
    up, key = aliased
    messages = [{"role": "user", "content": text(12, 200)}]
    openai_client = openai.OpenAI(base_url=f"{up.url}/v1", api_key=key, max_retries=0)
    answer = openai_client.chat.completions.create(model="sim", messages=messages, max_tokens=LIMIT)
    assert answer.usage is not None
    assert 0 < answer.usage.prompt_tokens + answer.usage.completion_tokens <= LIMIT
    client = anthropic.Anthropic(base_url=up.url, api_key=key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="exceed context limit"):
        client.messages.create(model="claude-sonnet-4-5", max_tokens=LIMIT, messages=messages)


def test_a_claude_model_name_is_served_through_an_alias(aliased: tuple[Started, str]) -> None:
    up, key = aliased
    client = anthropic.Anthropic(base_url=up.url, api_key=key, max_retries=0)
    message = client.messages.create(
        model="claude-sonnet-4-5", max_tokens=6, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.type == "message" and message.usage.output_tokens == 6
    assert message.model == "sim"  # the served model, as vLLM names it under any of its names
    with client.messages.stream(
        model="claude-haiku-4-5", max_tokens=4, messages=[{"role": "user", "content": "hey"}]
    ) as stream:
        assert "".join(stream.text_stream)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(
            model="claude-opus-4-1", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    models = httpx.get(f"{up.url}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
    assert [m["id"] for m in models["data"]] == ["sim", *ALIASES]


def test_without_keys_on_loopback_any_key_or_none_is_the_local_tenant(tmp_path: Path) -> None:
    env = {"APPLIANCE_SERVER__AUTH": "none"}
    with appliance_process(tmp_path, workers=1, env=env) as up:
        # As kv-cache-tester's trace_replay_tester.py: the model list without a key, then
        # streamed chats with the key EMPTY, usage included, X-Session-ID set.
        models = httpx.get(f"{up.url}/v1/models", timeout=10)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "sim"
        client = openai.OpenAI(api_key="EMPTY", base_url=f"{up.url}/v1", max_retries=0)
        stream = client.chat.completions.create(
            model="sim",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Session-ID": "kvct-1"},
        )
        usage = [chunk.usage for chunk in stream if chunk.usage is not None]
        assert usage and usage[-1].completion_tokens == 5
        bare = httpx.post(
            f"{up.url}/v1/chat/completions",
            json=HELLO,
            headers={"X-Session-ID": "kvct-2"},
            timeout=30,
        )
        assert bare.status_code == 200, bare.text
        state = httpx.get(f"{up.url}/admin/v1/state", timeout=10)
        assert state.status_code == 200  # the operator's routes too: loopback is the operator
        ledger = up.log.parent / "ledger.db"
        rows = [turns_of(ledger, s) for s in ("kvct-1", "kvct-2")]
    assert rows == [[("local", "ok")], [("local", "ok")]]
    assert "auth: none" in up.log.read_text()


def test_without_keys_off_loopback_up_is_refused_in_one_line(tmp_path: Path) -> None:
    r = run_up(
        tmp_path, "--host", "0.0.0.0", "--port", str(free_port()), APPLIANCE_SERVER__AUTH="none"
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "server.auth='none' is invalid" in r.stderr and "'0.0.0.0'" in r.stderr


def test_a_second_appliance_needs_only_its_own_port(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    port = api_port_with_free_followers(2)
    keys = [add_key(first, "ops", "--admin"), add_key(second, "ops", "--admin")]
    with ExitStack() as stack:
        ups = [
            stack.enter_context(
                appliance_process(first, workers=2, ports=(port, 0, 0), engine_ports=False)
            ),
            # its followed ports are the first one's second worker's: chosen free instead
            stack.enter_context(
                appliance_process(second, workers=1, ports=(port + 1, 0, 0), engine_ports=False)
            ),
        ]
        urls = []
        for up, key in zip(ups, keys, strict=True):
            auth = {"Authorization": f"Bearer {key}"}
            answer = httpx.post(
                f"{up.url}/v1/chat/completions", headers=auth, json=HELLO, timeout=30
            )
            assert answer.status_code == 200, answer.text
            state = httpx.get(f"{up.url}/admin/v1/state", headers=auth, timeout=10).json()
            urls.append([w["url"] for w in state["workers"]])
    assert urls[0] == [f"http://127.0.0.1:{port + 20}", f"http://127.0.0.1:{port + 21}"]
    assert len(urls[1]) == 1 and urls[1][0] not in urls[0]


def test_a_port_conflict_names_every_port_in_conflict_at_once(tmp_path: Path) -> None:
    api, base, kv = free_port(), free_port_block(1), free_port_block(1)
    with ExitStack() as stack:
        for port in (api, base, kv):
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", port))
            sock.listen()
        r = run_up(
            tmp_path,
            "--port",
            str(api),
            "--workers",
            "1",
            APPLIANCE_ENGINE__BASE_PORT=str(base),
            APPLIANCE_ENGINE__KV_EVENTS_BASE_PORT=str(kv),
        )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "appliance: 3 ports are in use: " in r.stderr
    named = {api: "the API", base: "HTTP of worker w0", kv: "KV events of worker w0"}
    for port, what in named.items():
        assert f"127.0.0.1:{port} ({what})" in r.stderr


def api_port_with_free_followers(workers: int) -> int:
    """A free API port, the next one free too, whose followed engine ports are free."""
    for _ in range(200):
        port = free_port()
        blocks = [port + offset for offset in PORT_OFFSETS.values()]
        wanted = [port + 1, *(b + i for b in blocks for i in range(workers))]
        if all(port_is_free(p) for p in wanted):
            return port
    raise RuntimeError("no API port with free followers")


def run_up(data_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    base.update(APPLIANCE_DATA_DIR=str(data_dir), **env)
    return subprocess.run(
        [str(BIN / "appliance"), "up", "--engine", "sim", *args],
        capture_output=True,
        text=True,
        env=base,
        timeout=60,
    )
