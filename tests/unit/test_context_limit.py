"""An over-long prompt is 400 on every model route, in that API's shape and words (vLLM's on
the OpenAI routes, Anthropic's on `/v1/messages`), and a model alias reaches the worker as
the served model's name: the routes driven through the API app with a desk that only
tokenises the turn and records the body it would send."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from starlette.testclient import TestClient

from appliance.api.app import create_api_app
from appliance.api.auth import Keys
from appliance.api.context import ApiContext
from appliance.api.errors import error_body
from appliance.api.turns.context_limit import ContextTooLong, check_context
from appliance.api.turns.requests import served_model
from appliance.api.turns.turn_prompts import ApiTurnTokenizer
from appliance.domain.errors import PromptOverflow
from appliance.services.turns.turn import Reply, TurnRequest

LIMIT = 64
KEY = {"Authorization": "Bearer k"}
CHAT_ANSWER = {
    "id": "c1",
    "model": "served",
    "choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1},
}


class Chars:
    """One token per character; a chat is its contents joined."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def encode_chat(self, messages: Any, **kwargs: Any) -> list[int]:
        return self.encode("".join(str(m.get("content") or "") for m in messages))


class Desk:
    """Tokenises each turn as the turn desk does first (through the API's adapter), and
    keeps the body it would send."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.tokenizer = ApiTurnTokenizer(Chars(), LIMIT)

    async def run(self, t: TurnRequest) -> Reply:
        self.tokenizer.tokenize(t, None)
        self.sent.append(t.body)
        return Reply(200, {}, orjson.dumps(CHAT_ANSWER))


def app(desk: Desk, aliases: dict[str, str] | None = None) -> TestClient:
    ctx = ApiContext(
        desk=desk,  # type: ignore[arg-type]
        tasks=SimpleNamespace(),  # type: ignore[arg-type]
        tokenizer=Chars(),
        keys=Keys({"k": SimpleNamespace(tenant="t", admin=False)}),  # type: ignore[dict-item]
        clock=SimpleNamespace(now=lambda: 0.0),  # type: ignore[arg-type]
        model="served",
        max_model_len=LIMIT,
        state=lambda: None,  # type: ignore[arg-type,return-value]
        healthy=lambda: True,
        ledger_failing=lambda: None,
        metrics=lambda: "",
        costs=lambda: [],
        model_aliases=aliases or {},
    )
    return TestClient(create_api_app(ctx))


LONG = "x" * 100
REQUESTS = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": LONG}], "max_tokens": 4},
    "/v1/completions": {"prompt": LONG, "max_tokens": 4},
    "/v1/responses": {"input": LONG, "max_output_tokens": 4},
    "/v1/messages": {"messages": [{"role": "user", "content": LONG}], "max_tokens": 4},
}


@pytest.mark.parametrize("path", sorted(REQUESTS))
def test_an_over_long_prompt_is_400_in_each_apis_shape(path: str) -> None:
    desk = Desk()
    with app(desk) as http:
        answer = http.post(path, json={"model": "served", **REQUESTS[path]}, headers=KEY)
    assert answer.status_code == 400 and desk.sent == []
    if path == "/v1/messages":
        message = "prompt is too long: 100 tokens > 64 maximum"
        assert answer.json() == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": message},
        }
        return
    error = answer.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "BadRequestError",
        "context_length_exceeded",
        "input_tokens",
    )
    assert error["message"].startswith(
        "This model's maximum context length is 64 tokens. However, your prompt contains 100 "
        "input tokens, which exceeds this limit even without any output tokens."
    )


def test_a_prompt_that_fits_with_too_long_an_answer_is_served_but_on_messages() -> None:
    """vLLM 0.32 shortens `max_tokens` to what fits (the worker does); Anthropic's API
    refuses, and Claude Code reads its words to ask again for less."""
    fits = "x" * 60  # 60 + 8 > 64
    desk = Desk()
    with app(desk) as http:
        chat = http.post(
            "/v1/chat/completions",
            headers=KEY,
            json={
                "model": "served",
                "messages": [{"role": "user", "content": fits}],
                "max_tokens": 8,
            },
        )
        messages = http.post(
            "/v1/messages",
            headers=KEY,
            json={
                "model": "served",
                "messages": [{"role": "user", "content": fits}],
                "max_tokens": 8,
            },
        ).json()
    assert chat.status_code == 200, chat.text
    assert [body["max_tokens"] for body in desk.sent] == [8]  # the worker shortens it
    assert messages["error"]["message"] == (
        "input length and `max_tokens` exceed context limit: 60 + 8 > 64, decrease input "
        "length or `max_tokens` and try again"
    )


def test_the_words_for_each_way_of_not_fitting() -> None:
    check_context(10, 100, 64)  # an OpenAI route: the answer is shortened, not refused
    check_context(63, 100, 64)  # room for one output token
    with pytest.raises(ContextTooLong) as too_long:
        check_context(10, 100, 64, answer_counts=True)
    assert too_long.value.message == (
        "This model's maximum context length is 64 tokens. However, you requested 110 tokens "
        "(10 in the messages, 100 in the completion). Please reduce the length of the "
        "messages or completion."
    )
    assert too_long.value.param is None
    check_context(63, None, 64, answer_counts=True)  # one output token counted when none asked
    with pytest.raises(ContextTooLong) as exactly:
        check_context(64, 8, 64)
    assert "you requested 65 tokens (64 in the messages, 1 in the completion)" in (
        exactly.value.message
    )
    shifted = ContextTooLong(70, 4, 63).shifted(1)
    assert (shifted.prompt_tokens, shifted.max_tokens, shifted.limit) == (71, 4, 64)
    assert shifted.in_anthropic_words().message == "prompt is too long: 71 tokens > 64 maximum"
    assert error_body(400, "m", "c")["error"]["type"] == "invalid_request_error"
    assert error_body(400, "m", "c", kind="BadRequestError")["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize("path", sorted(REQUESTS))
def test_an_alias_reaches_the_worker_as_the_served_model(path: str) -> None:
    desk = Desk()
    short = {**REQUESTS[path]}
    short.update({"messages": [{"role": "user", "content": "hi"}]} if "messages" in short else {})
    short.update({"prompt": "hi"} if "prompt" in short else {})
    short.update({"input": "hi"} if "input" in short else {})
    with app(desk, {"claude-sonnet-4-5": "served"}) as http:
        ok = http.post(path, json={"model": "claude-sonnet-4-5", **short}, headers=KEY)
        other = http.post(path, json={"model": "gpt-4o", **short}, headers=KEY)
    assert ok.status_code == 200, ok.text
    assert [body["model"] for body in desk.sent] == ["served"]
    assert other.status_code == 404 and len(desk.sent) == 1


def test_star_maps_any_name_and_the_model_list_names_the_aliases() -> None:
    desk = Desk()
    aliases = {"claude-haiku-4-5": "served", "*": "served"}
    with app(desk, aliases) as http:
        answer = http.post(
            "/v1/messages",
            headers=KEY,
            json={
                "model": "claude-opus-4-1",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        models = http.get("/v1/models", headers=KEY).json()["data"]
    assert answer.status_code == 200 and answer.json()["model"] == "served"
    assert desk.sent[0]["model"] == "served"
    assert [m["id"] for m in models] == ["served", "claude-haiku-4-5"]


def test_served_model_leaves_a_body_without_aliases_alone() -> None:
    body: dict[str, Any] = {"model": "other"}
    served_model(body, {})
    assert body == {"model": "other"}
    served_model(body, {"x": "served"})
    assert body == {"model": "other"}
    body = {"model": 7}
    served_model(body, {"*": "served"})
    assert body == {"model": 7}  # a bad type stays for the check to refuse


def test_only_a_prompt_that_leaves_no_room_for_one_token_is_an_overflow() -> None:
    """The refusal the idle reaper acts on (the harness compacts next): a prompt alone over
    the window, in either API's words, shifted or not; not an answer asked too long."""
    refusals = []
    for prompt, asked, answer_counts in [(64, None, False), (100, 4, True), (60, 8, True)]:
        with pytest.raises(ContextTooLong) as refused:
            check_context(prompt, asked, LIMIT, answer_counts=answer_counts)
        refusals.append(refused.value)
    overflow = [isinstance(r, PromptOverflow) for r in refusals]
    assert overflow == [True, True, False]
    assert [isinstance(r.in_anthropic_words(), PromptOverflow) for r in refusals] == overflow
    assert [isinstance(r.shifted(3), PromptOverflow) for r in refusals] == overflow
    assert all(r.in_anthropic_words().code == "context_length_exceeded" for r in refusals)
