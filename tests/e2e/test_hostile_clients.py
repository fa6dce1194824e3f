"""Hostile clients against one `appliance up --engine sim --workers 1`, over real sockets on
127.0.0.1: generated bodies, paths, queries, headers and methods for every route; heads and
bodies past their bounds, broken framing, slow senders and idle floods on raw sockets.

What must hold for every one of them: no 5xx (a 503 only where the API documents it), every
4xx and 5xx as the OpenAI-style error JSON, an answer within `ANSWER_S`, and afterwards the
appliance's memory back within 10 % of where it started. Hypothesis runs derandomized (the
same examples every run) and bounded (`EXAMPLES` per route)."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from appliance.api.turns.requests import MAX_BODY_BYTES
from tests.running import add_key, appliance_process

pytestmark = pytest.mark.e2e

REQUEST_S = 2.0
"""The fixture's `server.request_timeout_s`: a request's head and body arrive within it."""
IDLE_S = 4.0
"""The fixture's `server.idle_timeout_s`."""
ANSWER_S = 10.0
"""Every answer arrives within this."""
EXAMPLES = 100
BODY_LIMIT = MAX_BODY_BYTES
DOCUMENTED_503 = {"overloaded"}
"""The only 503 a healthy appliance may answer to a client's request (README, Admission)."""
KNOWN_TASK, KNOWN_SESSION = "known-task", "known-session"


@dataclass
class Target:
    url: str
    port: int
    tenant: str
    ops: str
    pid: int
    baseline_rss: int

    def rss(self) -> int:
        return int(psutil.Process(self.pid).memory_info().rss)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    data_dir = tmp_path_factory.mktemp("appliance-hostile")
    tenant, ops = add_key(data_dir, "alice"), add_key(data_dir, "ops", "--admin")
    env = {
        "APPLIANCE_SERVER__REQUEST_TIMEOUT_S": str(REQUEST_S),
        "APPLIANCE_SERVER__IDLE_TIMEOUT_S": str(IDLE_S),
    }
    with appliance_process(data_dir, workers=1, env=env) as up:
        port = int(up.url.rsplit(":", 1)[1])
        t = Target(up.url, port, tenant, ops, up.proc.pid, 0)
        _warm_up(t)
        t.baseline_rss = _settled_rss(t)
        yield t


@pytest.fixture(scope="module")
def client(target: Target) -> Iterator[httpx.Client]:
    """One client for the generated requests (a new one costs tens of ms): kept-alive
    connections, a new one whenever the appliance closed the last."""
    with httpx.Client(base_url=target.url, timeout=ANSWER_S) as c:
        yield c


def _warm_up(t: Target) -> None:
    """What every later request finds in place: a task, a session, each route served once."""
    auth = {"Authorization": f"Bearer {t.tenant}"}
    ops = {"Authorization": f"Bearer {t.ops}"}
    with httpx.Client(base_url=t.url, timeout=ANSWER_S) as c:
        assert c.post("/v1/tasks", json={"task_id": KNOWN_TASK}, headers=auth).status_code == 201
        for i in range(20):
            body = {
                "model": "sim",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": f"warm up {i}"}],
            }
            headers = auth | {"X-Session-ID": KNOWN_SESSION if i == 0 else f"warm-{i}"}
            assert c.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
            prompt = {"model": "sim", "max_tokens": 4, "prompt": f"warm up {i}"}
            assert c.post("/v1/completions", json=prompt, headers=auth).status_code == 200
        for path in ("/admin/v1/state", "/admin/v1/sessions", "/admin/v1/costs"):
            assert c.get(path, headers=ops).status_code == 200
        assert c.get(f"/admin/v1/sessions/{KNOWN_SESSION}", headers=ops).status_code == 200
        assert c.get(f"/v1/tasks/{KNOWN_TASK}", headers=auth).status_code == 200
        assert c.get("/metrics").status_code == 200
    # One body near the limit of each kind: what the first of them allocates for good (the
    # allocator's own structures sized to it) is where the appliance starts, not a leak.
    _big_bodies(t, 3, 1)


def _settled_rss(t: Target) -> int:
    """The appliance's RSS once it has stopped moving (the ledger's writes, timers)."""
    time.sleep(1.0)
    readings = [t.rss()]
    for _ in range(10):
        time.sleep(0.3)
        readings.append(t.rss())
        if abs(readings[-1] - readings[-2]) < 256 * 1024:
            break
    return readings[-1]


# --- what every answer must be --------------------------------------------------------------


def check_answer(r: httpx.Response, method: str, elapsed: float) -> None:
    what = f"{method} {r.request.url} -> {r.status_code} {r.text[:300]!r}"
    assert elapsed < ANSWER_S, f"answered after {elapsed:.1f} s: {what}"
    if r.status_code >= 500:
        assert r.status_code == 503, what
        assert error_shape(r)["code"] in {*DOCUMENTED_503, "overloaded_error"}, what
        assert int(r.headers["retry-after"]) >= 1, what
    if r.status_code >= 400 and method != "HEAD":
        error_shape(r)


def error_shape(r: httpx.Response) -> dict[str, Any]:
    """The OpenAI-style error JSON (appliance/api/errors.py), as the README promises; on the
    Messages API's route, that API's (its `type` stands for the code)."""
    what = f"{r.request.method} {r.request.url} -> {r.status_code} {r.text[:300]!r}"
    assert r.headers.get("content-type", "").startswith("application/json"), what
    body = r.json()
    if r.request.url.path == "/v1/messages" and r.request.method == "POST":
        assert isinstance(body, dict) and body.get("type") == "error", what
        error = body["error"]
        assert isinstance(error["type"], str) and isinstance(error["message"], str), what
        return {"code": error["type"], **error}
    assert isinstance(body, dict) and set(body) == {"error"}, what
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error), what
    assert isinstance(error["message"], str) and error["message"], what
    assert isinstance(error["type"], str), what
    # A worker's own refusal is relayed as vLLM writes it: its `code` is the HTTP status.
    assert isinstance(error["code"], str) or error["code"] == r.status_code, what
    assert error["param"] is None or isinstance(error["param"], str), what
    return dict(error)


def send(
    c: httpx.Client, method: str, path: str, headers: dict[str, bytes], body: bytes | None
) -> httpx.Response:
    start = time.monotonic()
    try:
        r = c.request(method, path, headers=headers, content=body)
    except httpx.TimeoutException:
        pytest.fail(f"{method} {path}: no answer within {ANSWER_S} s")
    check_answer(r, method, time.monotonic() - start)
    return r


# --- generated requests -------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)
json_values = st.recursive(
    scalars,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=10,
)


def field(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A value of the right kind three times in four, else anything JSON holds. (Not
    `one_of(good, good, good, junk)`: Hypothesis steers towards branches it has not
    exhausted, so a small `good` would hardly ever be drawn; a seed decides instead.)"""
    return st.tuples(st.integers(0, 2**32), good, json_values).map(
        lambda t: t[1] if random.Random(t[0]).random() < 0.75 else t[2]
    )


ids = st.one_of(
    st.sampled_from([KNOWN_TASK, KNOWN_SESSION, "", " ", "a/b", "x" * 257, "\x00", "é"]),
    st.text(max_size=40),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=12),
)
small = st.integers(min_value=1, max_value=4)
counts = st.integers(min_value=-2, max_value=140)
part = st.fixed_dictionaries(
    {"type": field(st.sampled_from(["text", "image_url", "input_audio"]))},
    optional={"text": field(st.text(max_size=40)), "image_url": json_values},
)
message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["user", "system", "assistant", "tool", "developer"]))},
    optional={
        "content": field(st.one_of(st.text(max_size=120), st.lists(part, max_size=3))),
        "name": json_values,
        "tool_calls": json_values,
        "tool_call_id": json_values,
        "reasoning_content": json_values,
    },
)
sampling = {
    "max_tokens": st.one_of(small, small, json_values, st.just(10**9)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": json_values})),
    "n": field(counts),
    "best_of": field(counts),
    "logprobs": field(st.one_of(st.booleans(), counts)),
    "top_logprobs": field(counts),
    "stop": field(st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=20))),
    "stop_token_ids": field(st.lists(st.integers(-1, 2**40), max_size=70)),
    "tools": field(counts.map(lambda n: [{"type": "function", "function": {"name": "f"}}] * n)),
    "logit_bias": field(st.dictionaries(st.text(max_size=6), st.integers(-200, 200), max_size=5)),
    "temperature": field(st.floats(-1, 3)),
    "top_p": field(st.floats(-1, 2)),
    "top_k": field(st.integers(-2, 100)),
    "seed": field(st.integers(-(2**65), 2**65)),
    "presence_penalty": json_values,
    "response_format": json_values,
    "tool_choice": json_values,
    "user": json_values,
    "session_id": field(ids),
    "cache_salt": field(st.text(max_size=20)),
    "ignore_eos": json_values,
    "min_tokens": field(st.integers(-1, 4)),
}


def bounded(body: dict[str, Any]) -> dict[str, Any]:
    """A body a worker would take is kept to a few output tokens (a few ms of the worker),
    whatever else it asks for: a limit past the window is served too, shortened to what the
    window leaves (as vLLM 0.32 does), and would take the worker seconds."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if (value is None and name == "max_tokens") or (type(value) is int and value > 4):
            body[name] = 4
    return body


def some_of(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """A few of `fields` (at most three): a body with every one of them is refused for one."""
    names = st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)
    return names.flatmap(lambda chosen: st.fixed_dictionaries({k: fields[k] for k in chosen}))


def model_body(
    required: dict[str, st.SearchStrategy[Any]], extra: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    base = st.fixed_dictionaries(required, optional={"max_tokens": sampling["max_tokens"]})
    return st.tuples(base, some_of(sampling | extra)).map(lambda p: bounded(p[0] | p[1]))


chat_body = model_body(
    {"model": field(st.just("sim")), "messages": field(st.lists(message, min_size=1, max_size=4))},
    {
        "max_completion_tokens": st.one_of(small, json_values),
        "add_generation_prompt": field(st.booleans()),
        "continue_final_message": json_values,
        "chat_template_kwargs": json_values,
    },
)
completion_body = model_body(
    {
        "model": field(st.just("sim")),
        "prompt": field(
            st.one_of(
                st.text(max_size=200),
                st.lists(st.integers(-1, 2**31 + 1), min_size=0, max_size=40),
                st.lists(st.text(max_size=10), max_size=3),
            )
        ),
    },
    {"echo": field(st.booleans()), "suffix": json_values, "add_special_tokens": json_values},
)
block = st.fixed_dictionaries(
    {"type": field(st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking"]))},
    optional={
        "text": field(st.text(max_size=40)),
        "input": json_values,
        "id": json_values,
        "name": json_values,
        "content": json_values,
        "source": json_values,
    },
)
anthropic_message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["user", "assistant", "system"]))},
    optional={"content": field(st.one_of(st.text(max_size=120), st.lists(block, max_size=3)))},
)
messages_body = st.fixed_dictionaries(
    {"model": field(st.just("sim")), "messages": field(st.lists(anthropic_message, max_size=4))},
    optional={
        "max_tokens": st.one_of(small, small, json_values),
        "system": json_values,
        "stream": field(st.booleans()),
        "tools": json_values,
        "tool_choice": json_values,
        "metadata": json_values,
        "stop_sequences": json_values,
        "temperature": json_values,
        "output_config": json_values,
    },
)
responses_body = model_body(
    {
        "model": field(st.just("sim")),
        "input": field(st.one_of(st.text(max_size=200), st.lists(message, min_size=1, max_size=3))),
    },
    {
        "instructions": field(st.text(max_size=60)),
        "previous_response_id": field(st.one_of(ids, st.just("resp_0"))),
        "max_output_tokens": st.one_of(small, json_values),
        "store": field(st.booleans()),
    },
)
task_body = st.fixed_dictionaries(
    {},
    optional={
        "task_id": field(ids),
        "parent_task_id": field(ids),
        "task_class": field(ids),
        "deadline_s": field(st.floats(-1, 1e6)),
        "budget": field(st.floats(-1, 1e6)),
        "max_children": field(st.integers(-1, 10**20)),
    },
)
event_body = st.fixed_dictionaries(
    {
        "type": field(
            st.sampled_from(
                ["tool_started", "tool_finished", "succeeded", "failed", "cancelled", "x"]
            )
        )
    },
    optional={
        "verified": field(st.booleans()),
        "evidence": field(st.one_of(st.text(max_size=50), st.just("e" * 65537))),
        "tool_class": field(ids),
        "expected_s": field(st.floats(-1, 1e9)),
    },
)
CRAFTED = [
    b"",
    b"{",
    b"[" * 5000,
    b'{"a":' * 3000 + b"1" + b"}" * 3000,
    b'{"a":' + b"[" * 101 + b"]" * 101 + b"}",
    b"NaN",
    b'{"model": NaN, "messages": Infinity}',
    b'{"x": 1e99999}',
    b'{"x": ' + b"9" * 5000 + b"}",
    b"\xef\xbb\xbf{}",
    '{"model":"sim"}'.encode("utf-16"),
    b'{"model": "sim", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
    b'{"model": "sim", "model": 1, "messages": []}',
    b'{"model": "sim", "messages": [{"role": "user", "content": "\\ud800"}]}',
    b"null",
    b"[]",
    b'"string"',
    b"\x00" * 64,
]


def body_of(fields: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[bytes]:
    return st.one_of(
        fields.map(_dump),
        fields.map(_dump),
        fields.map(_dump),
        json_values.map(_dump),
        st.binary(max_size=200),
        st.sampled_from(CRAFTED),
    )


def _dump(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


header_text = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
    max_size=300,
).map(lambda s: s.strip().encode("latin-1"))
AGENT_HEADERS = [
    "x-session-id",
    "x-task-id",
    "x-parent-task-id",
    "x-deadline-s",
    "x-priority",
    "x-tool-class",
    "x-expected-tool-wait-s",
    "idempotency-key",
    "content-type",
]
numbers = st.one_of(
    st.sampled_from(["nan", "inf", "-1", "1e999", "0", "60", "1.5", "", "9" * 40]), header_text
)
extra_headers = st.fixed_dictionaries(
    {},
    optional={
        name: st.one_of(numbers, header_text, st.sampled_from([b"s-1", b"60", b"1"])).map(
            lambda v: v if isinstance(v, bytes) else v.encode()
        )
        for name in AGENT_HEADERS
    },
)
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


@dataclass(frozen=True)
class RouteSpec:
    method: str
    template: str
    """`{id}` is a generated path segment."""
    body: st.SearchStrategy[bytes] | None
    query: bool = False
    """Whether the route reads a query (`tenant`, `turns`)."""


ROUTES = {
    "chat": RouteSpec("POST", "/v1/chat/completions", body_of(chat_body)),
    "completions": RouteSpec("POST", "/v1/completions", body_of(completion_body)),
    "messages": RouteSpec("POST", "/v1/messages", body_of(messages_body)),
    "responses": RouteSpec("POST", "/v1/responses", body_of(responses_body)),
    "create_task": RouteSpec("POST", "/v1/tasks", body_of(task_body)),
    "task_event": RouteSpec("POST", "/v1/tasks/{id}/events", body_of(event_body)),
    "cancel_task": RouteSpec("POST", "/v1/tasks/{id}/cancel", body_of(st.just({}))),
    "get_task": RouteSpec("GET", "/v1/tasks/{id}", None),
    "models": RouteSpec("GET", "/v1/models", None),
    "state": RouteSpec("GET", "/admin/v1/state", None),
    "sessions": RouteSpec("GET", "/admin/v1/sessions", None),
    "session": RouteSpec("GET", "/admin/v1/sessions/{id}", None, query=True),
    "release": RouteSpec("POST", "/admin/v1/sessions/{id}/release", None, query=True),
    "costs": RouteSpec("GET", "/admin/v1/costs", None),
    "metrics": RouteSpec("GET", "/metrics", None),
    "health": RouteSpec("GET", "/health", None),
}

queries = st.one_of(
    st.just(""),
    st.fixed_dictionaries(
        {},
        optional={
            "tenant": st.one_of(st.sampled_from(["alice", "ops", ""]), st.text(max_size=20)),
            "turns": st.one_of(st.integers(-5, 600).map(str), st.text(max_size=8)),
        },
    ).map(lambda q: urlencode(q)),
    st.text(max_size=60).map(lambda s: quote(s, safe="=&?/")),
)


BOUNDED = settings(
    max_examples=EXAMPLES,
    deadline=None,  # each answer has ANSWER_S (httpx's timeout), not Hypothesis's deadline
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@BOUNDED
@pytest.mark.parametrize("name", sorted(ROUTES))
@given(data=st.data())
def test_anything_at_any_route_gets_no_5xx_and_the_error_shape_in_time(
    target: Target, client: httpx.Client, name: str, data: st.DataObject
) -> None:
    """Any method, path segment, query, key, agent header and body at each route."""
    spec = ROUTES[name]
    method = data.draw(st.one_of(st.just(spec.method), st.sampled_from(METHODS)))
    segment = data.draw(st.one_of(st.sampled_from([KNOWN_TASK, KNOWN_SESSION]), ids))
    path = spec.template.replace("{id}", quote(segment, safe=""))
    query = data.draw(st.one_of(st.just(""), queries))
    who = data.draw(st.sampled_from(["tenant", "operator", None, "nope", ""]))
    headers = dict(data.draw(st.one_of(st.just({}), extra_headers)))
    if who is not None:
        key = {"tenant": target.tenant, "operator": target.ops}.get(who, who)
        scheme = data.draw(st.sampled_from(["Bearer ", "bearer ", "Basic ", "", "Bearer  "]))
        headers["authorization"] = (scheme + key).strip().encode()
    body = data.draw(st.one_of(st.none(), body_of(st.just({}))) if spec.body is None else spec.body)
    r = send(client, method, f"{path}?{query}" if query else path, headers, body)
    if name == "health" and method in ("GET", "HEAD"):
        assert r.status_code == 200, r.text  # the worker stays healthy throughout


@BOUNDED
@pytest.mark.parametrize(
    "name", sorted(n for n, s in ROUTES.items() if s.body is not None or s.query)
)
@given(data=st.data())
def test_generated_bodies_and_queries_from_a_rightful_caller_get_no_5xx_in_time(
    target: Target, client: httpx.Client, name: str, data: st.DataObject
) -> None:
    """The right method and key, the body's or query's fields generated: what reaches the
    validators, the task book, the session admin and the worker."""
    spec = ROUTES[name]
    segment = data.draw(st.one_of(st.sampled_from([KNOWN_TASK, KNOWN_SESSION]), ids))
    path = spec.template.replace("{id}", quote(segment, safe=""))
    if spec.query:
        path += "?" + data.draw(queries)
    key = target.ops if spec.template.startswith("/admin") else target.tenant
    headers = {"authorization": f"Bearer {key}".encode()}
    body = data.draw(st.none() if spec.body is None else spec.body)
    r = send(client, spec.method, path, headers, body)
    code = error_shape(r)["code"] if r.status_code >= 400 else ""
    event(f"{r.status_code} {code}")


# --- raw sockets: what no well-behaved client library sends ----------------------------------


def connect(t: Target) -> socket.socket:
    return socket.create_connection(("127.0.0.1", t.port), timeout=ANSWER_S)


def read_until_closed(sock: socket.socket, within_s: float = ANSWER_S) -> bytes:
    """Everything the appliance sends until it closes the connection (every refusal closes)."""
    sock.settimeout(within_s)
    out = b""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            piece = sock.recv(65536)
        except ConnectionResetError:
            break
        if not piece:
            break
        out += piece
    else:
        pytest.fail(f"the connection was still open after {within_s} s: {out[:300]!r}")
    return out


def exchange(t: Target, data: bytes) -> bytes:
    with connect(t) as sock:
        sock.sendall(data)
        return read_until_closed(sock)


def refusal(answer: bytes, status: int) -> dict[str, Any]:
    """The answer is `status` with the error JSON, and the only answer on its connection."""
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:300]
    assert answer.count(b"HTTP/1.1 ") == 1, answer[:600]
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    error = json.loads(body)["error"]
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["code"], str) and isinstance(error["type"], str), body
    return dict(error)


def answer_while_sending(sock: socket.socket, pieces: Iterator[bytes], pause_s: float) -> bytes:
    """Sends `pieces` one by one until the appliance answers; its answer."""
    for piece in pieces:
        try:
            sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            break  # it answered and closed while we were still sending
        sock.settimeout(pause_s)
        try:
            first = sock.recv(65536)
        except TimeoutError:
            continue
        return first + read_until_closed(sock)
    return read_until_closed(sock)


def test_a_head_past_its_bounds_is_431_before_it_is_all_sent(target: Target) -> None:
    sent = 0

    def big_header() -> Iterator[bytes]:
        nonlocal sent
        yield b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: "
        for _ in range(400):  # up to 25 MiB
            sent += 65536
            yield b"y" * 65536

    with connect(target) as sock:
        answer = answer_while_sending(sock, big_header(), 0.05)
    refusal(answer, 431)
    assert sent < 2**20
    many = b"GET /v1/models HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101))
    refusal(exchange(target, many + b"\r\n"), 431)
    line = b"GET /v1/" + b"m" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    refusal(exchange(target, line), 431)


def test_a_body_past_the_limit_is_413_before_it_is_sent(target: Target) -> None:
    declared = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
    start = time.monotonic()
    refusal(exchange(target, declared % (BODY_LIMIT + 1)), 413)
    assert time.monotonic() - start < 1.0  # at once: not after the request deadline
    # Asked to continue, it refuses instead.
    expect = declared.replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n")
    refusal(exchange(target, expect % (10 * BODY_LIMIT)), 413)
    # A chunked body has no length to declare: it is cut where it passes the limit.
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        yield b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        for _ in range(40):  # up to 40 MiB
            sent += 2**20
            yield b"100000\r\n" + b"x" * 2**20 + b"\r\n"

    with connect(target) as sock:
        answer = answer_while_sending(sock, chunks(), 0.05)
    refusal(answer, 413)
    assert sent <= BODY_LIMIT + 4 * 2**20


BAD_FRAMING = {
    "chunk size not hex": b"zz\r\nabc\r\n0\r\n\r\n",
    "chunk shorter than its size": b"5\r\nabc\r\n0\r\n\r\n",
    "chunk size overflows": b"fffffffffffffffffffff\r\nabc\r\n0\r\n\r\n",
    "no CRLF after a chunk": b"3\r\nabcXY0\r\n\r\n",
    "negative chunk size": b"-3\r\nabc\r\n0\r\n\r\n",
}
BAD_HEADS = {
    "not HTTP": b"NOT HTTP\r\n\r\n",
    "content-length and chunked": b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    "two content-lengths": b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
    b"Content-Length: 5\r\n\r\nabcde",
    "negative content-length": b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    "content-length not a number": b"POST /v1/tasks HTTP/1.1\r\nContent-Length: x\r\n\r\n",
    "a space before the colon": b"GET /health HTTP/1.1\r\nHost : x\r\n\r\n",
    "a header without a colon": b"GET /health HTTP/1.1\r\nHost x\r\n\r\n",
    "a NUL in a header": b"GET /health HTTP/1.1\r\nX-A: a\x00b\r\n\r\n",
    "HTTP/2's preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "an upgrade": b"GET /health HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
}


@pytest.mark.parametrize("case", sorted(BAD_FRAMING) + sorted(BAD_HEADS))
def test_broken_framing_is_400_with_the_error_json(target: Target, case: str) -> None:
    head = b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    data = head + BAD_FRAMING[case] if case in BAD_FRAMING else BAD_HEADS[case]
    refusal(exchange(target, data), 400)


ODD_REQUESTS = [
    b"GET * HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET http://elsewhere/v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    b"CONNECT elsewhere:443 HTTP/1.1\r\nHost: elsewhere:443\r\n\r\n",
    b"GET /health HTTP/1.0\r\n\r\n",
    b"GET /v1/tasks/%ff%fe HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /v1/tasks/%zz HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /v1/tasks/a%00b HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /admin/v1/sessions/%2F%2F..%2F HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET //v1/models?%%%&&&==? HTTP/1.1\r\nHost: x\r\n\r\n",
    b"BREW /coffee HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v1/tasks HTTP/1.1\r\nContent-Length: 0\r\nAuthorization: Bearer \xff\r\n\r\n",
]


def test_odd_but_parseable_requests_get_an_answer_below_500(target: Target) -> None:
    for data in ODD_REQUESTS:
        answer = exchange(target, data.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1))
        status = int(answer.split(b" ", 2)[1])
        assert 200 <= status < 500, (data, answer[:300])
        if status >= 400:
            refusal(answer, status)


def test_a_body_cut_short_by_a_hang_up_leaves_the_appliance_serving(target: Target) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
    for _ in range(50):
        with connect(target) as sock:
            sock.sendall(head + b'{"model": "sim"')
    with connect(target) as sock:  # half-closed: the appliance reads the end of the stream
        sock.sendall(head + b"{")
        sock.shutdown(socket.SHUT_WR)
        start = time.monotonic()
        assert read_until_closed(sock) == b""  # nothing to answer: it closes its side too
        assert time.monotonic() - start < REQUEST_S / 2  # at the end, not at the deadline
    r = httpx.get(f"{target.url}/v1/models", headers=_auth(target), timeout=ANSWER_S)
    assert r.status_code == 200


def _auth(t: Target) -> dict[str, str]:
    return {"Authorization": f"Bearer {t.tenant}"}


def test_slow_senders_are_cut_off_at_the_request_deadline(target: Target) -> None:
    """One byte a second, in the head or in the body: 408 at `server.request_timeout_s`."""
    head = b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
    results: dict[str, tuple[float, bytes]] = {}

    def trickle(name: str, data: bytes, prefix: bytes = b"") -> None:
        with connect(target) as sock:
            start = time.monotonic()
            sock.sendall(prefix)
            answer = answer_while_sending(sock, (bytes([b]) for b in data), 1.0)
            results[name] = (time.monotonic() - start, answer)

    threads = [
        threading.Thread(target=trickle, args=("head", head)),
        threading.Thread(target=trickle, args=("body", b"x" * 100, head)),
    ]
    for thread in threads:
        thread.start()
    # Meanwhile everyone else is served at once.
    r = httpx.get(f"{target.url}/v1/models", headers=_auth(target), timeout=1.0)
    assert r.status_code == 200
    for thread in threads:
        thread.join(REQUEST_S + 5)
    for name, (took, answer) in results.items():
        refusal(answer, 408)
        assert REQUEST_S - 0.2 <= took < REQUEST_S + 1.5, (name, took)
    assert set(results) == {"head", "body"}


def test_an_idle_flood_delays_no_request_and_is_closed_when_idle(target: Target) -> None:
    idle = [connect(target) for _ in range(200)]
    partial = [connect(target) for _ in range(50)]
    try:
        for sock in partial:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost:")
        start = time.monotonic()
        with httpx.Client(base_url=target.url, timeout=ANSWER_S) as c:
            for _ in range(10):
                assert c.get("/v1/models", headers=_auth(target)).status_code == 200
        assert time.monotonic() - start < 2.0
        for sock in partial:  # each cut off at its request's deadline
            refusal(read_until_closed(sock, REQUEST_S + 2), 408)
        for sock in idle:  # closed, having never sent a byte, once idle for `idle_timeout_s`
            assert read_until_closed(sock, IDLE_S + 2) == b""
    finally:
        for sock in idle + partial:
            sock.close()


def test_pipelined_requests_never_read_are_not_buffered_without_bound(target: Target) -> None:
    """A client that pipelines requests and reads no answer: the appliance stops reading
    (its memory stays put) instead of queueing every request it is sent."""
    before = target.rss()
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 200 + b"\r\n\r\n"
    batch = request * 4096  # about 1 MiB
    sent = 0
    with connect(target) as sock:
        sock.settimeout(0.5)
        try:
            for _ in range(200):  # up to 200 MiB
                sock.sendall(batch)
                sent += len(batch)
        except TimeoutError:
            pass  # the appliance stopped reading: the kernel's buffers are full
        grown = target.rss() - before
    # Reading all it was sent, the appliance grew by 44 MiB in those seconds, and on.
    assert sent < 64 * 2**20, f"{sent / 2**20:.0f} MiB of requests taken, none answered"
    assert grown < 32 * 2**20, f"{grown / 2**20:.0f} MiB more memory"


# --- memory: last, after everything above -------------------------------------------------


def _big_bodies(t: Target, count: int, at_once: int) -> None:
    """`count` bodies near the limit, `at_once` at a time: one long string, a million small
    objects (about 200 MiB of Python objects while it is checked), chunked, in turn."""
    text = {"model": "nope", "messages": [{"role": "user", "content": "x" * (BODY_LIMIT - 200)}]}
    small = {"model": "nope", "x": [{"a": 1}] * ((BODY_LIMIT - 200) // 8)}
    bodies = [_dump(text), json.dumps(small, separators=(",", ":")).encode()]

    def chunked() -> Iterator[bytes]:
        yield b'{"model": "nope", "x": "'
        for _ in range(7):
            yield b"y" * 2**20
        yield b'"}'

    def one(i: int) -> None:
        with httpx.Client(base_url=t.url, headers=_auth(t), timeout=ANSWER_S) as c:
            r = c.post("/v1/completions", content=bodies[i % 3] if i % 3 < 2 else chunked())
            assert r.status_code == 404, r.text[:300]  # read, parsed, refused: no such model

    with ThreadPoolExecutor(at_once) as pool:
        list(pool.map(one, range(count)))


def test_memory_is_back_within_ten_percent_of_its_start(target: Target) -> None:
    """After everything above and a round of bodies near the limit, the appliance's RSS is
    within 10 % of what it was after warming up."""
    _big_bodies(target, 24, 4)
    after = _settled_rss(target)
    start = target.baseline_rss
    assert after <= start * 1.10, (
        f"RSS {after / 2**20:.0f} MiB after the hostile clients, {start / 2**20:.0f} MiB before"
    )
