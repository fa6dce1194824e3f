"""A session's next turn forwarded before it is tokenised: only when it appends plain text,
never above the model's length (the bound holds for real tokenizers), placed as the whole
ids would place it, and tokenised and hashed afterwards exactly as a whole turn is."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.domain.block_hash import BlockHasher, HashAlgo, RequestKeys
from appliance.domain.records import SessionId, TaskId, TenantId, WorkerId
from appliance.services.sessions.appended_text import appended, resumable
from appliance.services.sessions.chat_tokens import encode_chat_text
from appliance.services.sessions.sessions import SessionState
from appliance.services.turns.turn import TurnRequest
from appliance.tokenization.tokenizer import FallbackTokenizer, HfTokenizer
from tests.fakes import FakeTurnTokenizer
from tests.unit.test_hf_tokenizer_split import _byte_level, _model_dir
from tests.unit.test_queue_book import setup

WORDS = ["alpha", " beta", "\n", "é", "ü42", "<s>", "</s>", "日本語", "🙂", "  ", "x" * 30]


def chat(rng: random.Random, n: int) -> list[dict[str, Any]]:
    roles = ["user", "assistant", "tool"]
    return [
        {"role": rng.choice(roles), "content": "".join(rng.choices(WORDS, k=rng.randrange(40)))}
        for _ in range(n)
    ]


def test_only_a_turn_that_appends_plain_text_is_forwarded_untokenised() -> None:
    rng = random.Random(1)
    before = [{"role": "system", "content": "tools"}, *chat(rng, 3)]
    after = [*before, {"role": "tool", "content": "é!", "tool_call_id": "c1"}]
    assert appended(before, after) is not None
    assert appended(before, after).text_bytes == len("toolé!c1".encode())  # type: ignore[union-attr]
    assert appended(before, before) is None  # nothing appended
    rewritten = [dict(m) for m in after]
    rewritten[1]["content"] = "edited"
    assert appended(before, rewritten) is None
    parts = [*before, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert appended(before, parts) is None
    calls = [*before, {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}]
    assert appended(before, calls) is None

    session = SessionState(TenantId("a"), SessionId("s"), 0.0)
    assert resumable(session, after) is None  # no earlier turn
    session.chat = encode_chat_text("x", lambda text: [1], ())
    session.messages = before
    session.chain = BlockHasher(HashAlgo.SHA256_CBOR, 4).chain([1, 2, 3, 4])
    assert resumable(session, after) is not None
    session.in_flight = 1  # a turn still running: its ids are not known yet
    assert resumable(session, after) is None


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    hf = HfTokenizer(_model_dir(tmp_path_factory.mktemp("bl"), _byte_level))
    return [FallbackTokenizer(), hf]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_the_bound_is_never_below_the_turns_real_length(tokenizers: list[Any], seed: int) -> None:
    rng = random.Random(seed)
    for tok in tokenizers:
        before = chat(rng, rng.randrange(1, 6))
        after = [*before, *chat(rng, rng.randrange(1, 4))]
        n_before = len(tok.encode_chat(before, add_generation_prompt=True))
        n_after = len(tok.encode_chat(after, add_generation_prompt=True))
        added = appended(before, after)
        assert added is not None
        assert n_after <= added.token_bound(n_before)


def test_an_untokenised_turn_is_placed_at_home_and_hashed_after_it_is_sent() -> None:
    tokenizer = FakeTurnTokenizer()
    wired, workers = setup(tokenizer=tokenizer)
    hasher = BlockHasher(HashAlgo.SHA256_CBOR, 16)
    first, second = list(range(100)), [*range(100), *range(1000, 1040)]
    sent_before_tokenised: list[bool] = []

    def tokenize(turn: TurnRequest) -> list[int]:
        # The request is on its way: the queue book counts its prefill at a worker.
        sent_before_tokenised.append(any(wired.queues.routed_s(w.id, 100.0) for w in workers))
        return second

    tokenizer.ids = tokenize  # the first turn comes tokenised: only the second asks

    def turn(ids: list[int] | None, **kw: Any) -> TurnRequest:
        return TurnRequest(
            TenantId("a"),
            "/v1/chat/completions",
            {"model": "m"},
            ids,
            TaskId("a/t"),
            SessionId("s"),
            **kw,
        )

    async def main() -> None:
        await wired.desk.handle(turn(first))
        session = wired.desk.sessions.get(TenantId("a"), SessionId("s"))
        assert session is not None and session.home is not None
        home = session.home
        wired.index.blocks = {home: 6}  # the first prompt
        reply = await wired.desk.handle(turn(None, estimated_tokens=140))
        assert reply.headers["X-Appliance-Worker"] == home
        salted = RequestKeys(cache_salt="salt-a")
        assert session.chain == hasher.chain(second, keys=salted)
        assert list(session.token_ids) == list(second)
        assert sent_before_tokenised == [True]

    asyncio.run(main())
    assert {w.id for w in workers} == {WorkerId("w0"), WorkerId("w1")}


def test_a_turn_that_fails_to_tokenise_makes_the_next_one_tokenise_first(
    tmp_path: Path,
) -> None:
    def broken(turn: TurnRequest) -> list[int]:
        raise ValueError("template error")

    wired, _ = setup(tokenizer=FakeTurnTokenizer(broken))

    async def main() -> None:
        first = TurnRequest(
            TenantId("a"),
            "/v1/chat/completions",
            {"model": "m"},
            list(range(100)),
            TaskId("a/t"),
            SessionId("s"),
            chat=encode_chat_text("x", lambda text: [1], ()),
            messages=[{"role": "user", "content": "x"}],
        )
        await wired.desk.handle(first)
        session = wired.desk.sessions.get(TenantId("a"), SessionId("s"))
        assert session is not None and session.messages is not None
        untokenised = TurnRequest(
            TenantId("a"),
            "/v1/chat/completions",
            {"model": "m"},
            None,
            TaskId("a/t"),
            SessionId("s"),
            estimated_tokens=120,
        )
        await wired.desk.handle(untokenised)
        assert session.chat is None and session.messages is None
        assert resumable(session, [{"role": "user", "content": "x"}, {"role": "user"}]) is None

    asyncio.run(main())
