"""Recorded agent sessions as live chat requests (`workload/agent_sessions.py`): each hash id
is one 64-token block of text under the simulated engine's tokenizer, equal ids give equal
text and distinct ids distinct text, the warm prefix is shared across sessions, a prompt that
re-sends the previous one only appends a message, and an answer asked to call a tool is
exactly the trace's output tokens long in the simulated engine."""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace

import pytest

from appliance.sim.entrypoints.tool_calls import plan_reply
from appliance.tokenization.tokenizer import FallbackTokenizer
from appliance.workload.agent_sessions import (
    BLOCK_TOKENS,
    TOOL_CALL_TOKENS,
    WARM_SCOPE,
    SessionPrompts,
    block_words,
    warm_blocks,
)
from appliance.workload.agent_traces import TraceRequest, read_agent_sessions
from tests.paths import DATA

TOK = FallbackTokenizer()
TEMPLATE_BASE, TEMPLATE_PER_MESSAGE = 5, 6
"""The fallback template's tokens: BOS and the generation prompt, and each message's role
line and end (`<|role|>\\n ... </s>\\n`)."""


def tokens(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def req(
    n_in: int, ids: Iterable[int], *, out: int = 10, stop: str | None = "tool_use"
) -> TraceRequest:
    return TraceRequest(0.0, n_in, out, tuple(ids), stop, 0.0, None)


def words_of(messages: list[dict[str, str]]) -> list[str]:
    return [w for m in messages for w in m["content"].split(" ")]


def test_a_block_is_64_tokens_the_same_for_the_same_key() -> None:
    a, b = block_words(("s", 1)), block_words(("s", 2))
    assert a == block_words(("s", 1)) and a != b and a != block_words(("t", 1))
    assert len(a) == BLOCK_TOKENS
    assert len(tokens(" ".join(a))) == BLOCK_TOKENS
    assert len(tokens(" ".join(a + b))) == 2 * BLOCK_TOKENS
    assert tokens(" ".join(a + b))[BLOCK_TOKENS:] == tokens(" " + " ".join(b))


def test_equal_ids_give_equal_blocks_and_a_prompt_is_its_input_tokens() -> None:
    steps = [req(200, [1, 2, 3]), req(300, [1, 2, 3, 4]), req(260, [1, 5, 3, 4])]
    prompts = SessionPrompts(steps, "s1")
    for k, step in enumerate(steps):
        sent = prompts.request(k)
        text = words_of(sent.messages)
        assert len(text) == step.input_tokens == sent.input_tokens
        for j, x in enumerate(step.hash_ids):
            assert tuple(text[64 * j : 64 * j + 64]) == block_words(("s1", x))
        rendered = TOK.encode_chat(sent.messages)
        n = len(sent.messages)
        assert len(rendered) == step.input_tokens + TEMPLATE_BASE + TEMPLATE_PER_MESSAGE * n


def test_a_prompt_that_resends_the_previous_appends_one_message() -> None:
    steps = [req(150, [1, 2]), req(300, [1, 2, 3, 4]), req(140, [1, 9])]
    prompts = SessionPrompts(steps, "s")
    first, second, third = (prompts.request(k) for k in range(3))
    assert second.messages[: len(first.messages)] == first.messages
    assert len(second.messages) == len(first.messages) + 1
    # the 22 words past the first prompt's blocks are the start of block 3
    assert words_of(first.messages)[128:] == list(block_words(("s", 3))[:22])
    # history rewritten: the re-sent part stays whole, the rest is one message
    assert len(third.messages) == 1
    assert words_of(third.messages)[:64] == list(block_words(("s", 1)))
    assert words_of(third.messages)[64:128] == list(block_words(("s", 9)))


def test_the_warm_prefix_is_shared_across_sessions_and_nothing_else() -> None:
    warm = warm_blocks(system_tokens=100, tool_tokens=200)
    assert warm == 2  # half of 300 tokens, in whole 64-token blocks
    a = SessionPrompts([req(320, [1, 2, 3, 4, 5])], "u0.1", (1, 2)).request(0)
    b = SessionPrompts([req(320, [1, 2, 3, 4, 5])], "u1.1", (1, 2)).request(0)
    assert a.messages[0] == b.messages[0] and a.messages[0]["role"] == "system"
    assert words_of(a.messages[:1]) == [
        *block_words((WARM_SCOPE, 0)),
        *block_words((WARM_SCOPE, 1)),
    ]
    assert a.messages[1] != b.messages[1]


def test_a_tool_call_answer_is_the_traces_output_tokens_in_the_simulated_engine() -> None:
    prompts = SessionPrompts(
        [req(64, [1], out=300), req(64, [1], out=5), req(64, [1], out=40, stop="end_turn")], "s"
    )
    for k, expected, calls in ((0, 300, True), (1, TOOL_CALL_TOKENS + 1, True), (2, 40, False)):
        sent = prompts.request(k)
        body = sent.body()
        assert sent.max_tokens == body["max_tokens"] == expected
        if not calls:
            assert "tools" not in body and body["extra_body"] == {"ignore_eos": True}
            continue
        ask = SimpleNamespace(tools=body["tools"], tool_choice="auto", messages=sent.messages)
        plan = plan_reply(ask, f"r{k}")
        assert plan is not None and plan.calls and plan.calls[0].name == "run_tool"
        assert len(tokens(plan.text)) == expected


@pytest.mark.parametrize("name", ["trace_0058", "trace_0277", "trace_0295"])
def test_the_vendored_sessions_prompts_are_their_blocks(name: str) -> None:
    (session,) = read_agent_sessions(DATA / "kvct" / f"{name}.json.gz")
    steps = [s for s in session.own_requests() if s.input_tokens + s.output_tokens <= 131072][:40]
    warm = warm_blocks(session.system_tokens, session.tool_tokens)
    prompts = SessionPrompts(steps, "run", steps[0].hash_ids[:warm])
    previous: list[dict[str, str]] = []
    appended = 0
    for k, step in enumerate(steps):
        sent = prompts.request(k)
        text = words_of(sent.messages)
        assert len(text) == step.input_tokens
        for j in (warm, len(step.hash_ids) - 1):
            if warm <= j < len(step.hash_ids):
                assert tuple(text[64 * j : 64 * j + 64]) == block_words(("run", step.hash_ids[j]))
        appended += sent.messages[: len(previous)] == previous
        previous = sent.messages
    assert appended >= len(steps) * 0.8  # most turns re-send the previous prompt whole
