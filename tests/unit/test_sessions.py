"""A session's incremental tokenising and hashing give exactly what doing it whole gives."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from pytest import MonkeyPatch

from appliance.api.turns.requests import prompt_tokens
from appliance.domain.block_hash import BlockHasher, HashAlgo, RequestKeys
from appliance.domain.records import SessionId, TaskId, TenantId
from appliance.services.sessions.chat_tokens import ChatEncoder, encode_chat_text
from appliance.services.sessions.sessions import SessionTable
from appliance.tokenization.tokenizer import FallbackTokenizer

TOK = FallbackTokenizer()
PIECES = ["alpha", " beta", "\n", "  ", "<s>", "</s>", "<pad>", "<unk>", "<", "/s>", "!?", "é"]


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n))


def _encode(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32))
def test_a_growing_chat_tokenises_as_a_whole_encode_does(seed: int) -> None:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": _text(rng, 30)}]
    previous = None
    for _ in range(6):
        if rng.random() < 0.2 and len(messages) > 1:  # the client rewrites history
            messages[rng.randrange(len(messages))]["content"] = _text(rng, 10)
        messages.append({"role": "user", "content": _text(rng, 12)})
        text = TOK.render_chat(messages, add_generation_prompt=True)
        chat = encode_chat_text(text, _encode, TOK.split_before, previous)
        assert list(chat.ids) == TOK.encode_chat(messages, add_generation_prompt=True)
        messages.append({"role": "assistant", "content": _text(rng, 8)})
        previous = chat


def test_a_new_turn_tokenises_only_what_it_appends() -> None:
    seen: list[str] = []

    def encode(text: str) -> list[int]:
        seen.append(text)
        return _encode(text)

    messages = [{"role": "system", "content": "context " * 500}, {"role": "user", "content": "a"}]
    first = encode_chat_text(TOK.render_chat(messages), encode, TOK.split_before)
    messages += [{"role": "assistant", "content": " reply"}, {"role": "user", "content": "b"}]
    seen.clear()
    second = encode_chat_text(TOK.render_chat(messages), encode, TOK.split_before, first)
    assert list(second.ids) == TOK.encode_chat(messages)
    assert sum(map(len, seen)) < 100


def test_a_tokenizer_without_split_points_is_tokenised_whole() -> None:
    class Whole(FallbackTokenizer):
        split_before = ()

    body = {"model": "sim", "messages": [{"role": "user", "content": "hello there"}]}
    path = "/v1/chat/completions"
    ids, chat = prompt_tokens(path, body, Whole(), model="sim", max_model_len=100)
    assert chat is None and ids == TOK.encode_chat(body["messages"])
    ids2, chat2 = prompt_tokens(path, body, TOK, model="sim", max_model_len=100)
    assert chat2 is not None and list(ids2) == ids


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32))
def test_a_session_chain_equals_the_whole_prompts_chain(seed: int) -> None:
    rng = random.Random(seed)
    hasher = BlockHasher.for_engine(HashAlgo.SHA256_CBOR, 4, "0")
    table = SessionTable(hasher)
    state = table.open(TenantId("t"), SessionId("s"), 0.0)
    ids = [rng.randrange(50) for _ in range(rng.randrange(0, 30))]
    for _ in range(8):
        keep = rng.randrange(len(ids) + 1) if rng.random() < 0.5 else len(ids)
        ids = ids[:keep] + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
        salt = "a" if rng.random() < 0.9 else "b"
        chain = table.hash_prompt(state, ids, salt)
        assert chain == hasher.chain(ids, keys=RequestKeys(cache_salt=salt))


def test_a_new_session_reuses_a_long_piece_another_session_tokenised() -> None:
    seen: list[str] = []

    def encode(text: str) -> list[int]:
        seen.append(text)
        return _encode(text)

    encoder = ChatEncoder(encode, TOK.split_before, min_chars=100)
    system = {"role": "system", "content": "shared context " * 200}
    for question in ("first?", "second?"):
        seen.clear()
        messages = [system, {"role": "user", "content": question}]
        assert list(encoder(TOK.render_chat(messages)).ids) == TOK.encode_chat(messages)
    assert max(map(len, seen)) < 100  # the second session tokenised only its question


def test_a_new_sessions_chain_starts_from_a_shared_prefix(monkeypatch: MonkeyPatch) -> None:
    hasher = BlockHasher.for_engine(HashAlgo.SHA256_CBOR, 4, "0")
    table = SessionTable(hasher)
    hashed: list[int] = []
    run = BlockHasher._hash_run

    def counting(self: BlockHasher, tokens, first, parent, keys):  # type: ignore[no-untyped-def]
        hashed.append(len(tokens) // self.block_size)
        return run(self, tokens, first, parent, keys)

    monkeypatch.setattr(BlockHasher, "_hash_run", counting)
    shared = list(range(100, 140))  # 10 blocks
    a = table.open(TenantId("t"), SessionId("a"), 0.0)
    table.hash_prompt(a, [*shared, 1, 2, 3, 4, 5], "salt")
    b = table.open(TenantId("t"), SessionId("b"), 0.0)
    hashed.clear()
    chain = table.hash_prompt(b, [*shared, 9, 9, 9, 9], "salt")
    assert sum(hashed) == 1
    assert chain == hasher.chain([*shared, 9, 9, 9, 9], keys=RequestKeys(cache_salt="salt"))
    c = table.open(TenantId("u"), SessionId("c"), 0.0)  # another salt shares nothing
    hashed.clear()
    table.hash_prompt(c, [*shared, 9, 9, 9, 9], "other")
    assert sum(hashed) == 11


def test_tools_are_rendered_into_the_prompt_as_the_worker_renders_them() -> None:
    class WithTools(FallbackTokenizer):
        chat_template = (
            "{% if tools %}{% for t in tools %}tool {{ t.function.name }}\n{% endfor %}{% endif %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        )

    tok, path = WithTools(), "/v1/chat/completions"
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    messages = [{"role": "user", "content": "hello there"}]
    body = {"model": "sim", "messages": messages, "tools": tools}
    ids, _ = prompt_tokens(path, body, tok, model="sim", max_model_len=100)
    assert list(ids) == tok.encode_chat(messages, tools=tools)
    plain, _ = prompt_tokens(path, {**body, "tools": None}, tok, model="sim", max_model_len=100)
    assert len(plain) < len(ids)


def test_a_turn_that_named_no_session_nor_task_leaves_no_session_behind() -> None:
    """Every plain request used to leave a session holding its prompt until the cap of
    100,000 (the soak's memory grew with them); one with a session or a task stays."""
    table = SessionTable(BlockHasher(HashAlgo.SHA256_CBOR, 16))
    tenant = TenantId("t")
    kept = []
    for sid, task in (
        ("task:t/turn-1a", "t/turn-1a"),
        ("s-1", "t/turn-2b"),
        ("task:t/job", "t/job"),
    ):
        state = table.open(tenant, SessionId(sid), 0.0)
        state.task_id = TaskId(task)
        table.began(state, 0.0)
        table.began(state, 0.0)  # two turns at once: it stays until the last has ended
        table.ended(state, 1.0)
        kept.append(table.get(tenant, SessionId(sid)) is not None)
        table.ended(state, 2.0)
    assert kept == [True, True, True]
    assert [s.session_id for s in table] == ["s-1", "task:t/job"]


def test_a_tasks_end_ends_its_sessions_once_no_turn_of_them_runs() -> None:
    table = SessionTable(BlockHasher(HashAlgo.SHA256_CBOR, 16))
    t, done, other = TenantId("t"), TaskId("t/done"), TaskId("t/other")
    idle, busy, elsewhere = (table.open(t, SessionId(s), 0.0) for s in ("idle", "busy", "else"))
    for state, task in ((idle, done), (busy, done), (elsewhere, other)):
        table.bind_task(state, task)
        state.messages = [{"role": "user", "content": "hi"}]
    table.began(busy, 1.0)
    table.forget_task(done)
    assert table.get(t, SessionId("idle")) is None and idle.messages is None
    assert table.get(t, SessionId("busy")) is busy  # its turn still runs
    table.ended(busy, 2.0)
    assert table.get(t, SessionId("busy")) is None and busy.messages is None
    assert [s.session_id for s in table] == ["else"]
    table.bind_task(elsewhere, done)  # a session that moved to another task: that one's now
    table.forget_task(other)
    assert table.get(t, SessionId("else")) is elsewhere


def _system_chat() -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "you are an agent " * 50},
        {"role": "developer", "content": "house rules " * 10},
        {"role": "user", "content": "fix the bug"},
    ]


def test_a_first_turns_stem_is_exactly_its_system_messages_tokens() -> None:
    messages = _system_chat()
    body = {"model": "sim", "messages": messages}
    ids, chat = prompt_tokens("/v1/chat/completions", body, TOK, model="sim", max_model_len=9000)
    assert chat is not None
    alone = TOK.encode_chat(messages[:2], add_generation_prompt=False)
    # It ends at the last cut in the text both share: the last message's closing marks
    # (here `</s>\n`, a cut before them) are not part of it.
    assert len(alone) - 2 == chat.stem < len(ids)
    assert list(ids[: chat.stem]) == alone[: chat.stem]


def test_a_chat_without_system_messages_or_tools_has_no_stem() -> None:
    body = {"model": "sim", "messages": [{"role": "user", "content": "hello " * 40}]}
    _, chat = prompt_tokens("/v1/chat/completions", body, TOK, model="sim", max_model_len=900)
    assert chat is not None and chat.stem == 0


def test_the_stem_goes_on_while_later_turns_keep_it_and_ends_when_it_is_rewritten() -> None:
    messages = _system_chat()
    path, limit = "/v1/chat/completions", 9000
    _, first = prompt_tokens(
        path, {"model": "sim", "messages": messages}, TOK, model="sim", max_model_len=limit
    )
    assert first is not None and first.stem > 0
    messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
    text = TOK.render_chat(messages, add_generation_prompt=True)
    second = encode_chat_text(text, _encode, TOK.split_before, first)
    assert second.stem == first.stem
    messages[0] = {"role": "system", "content": "a new brief"}
    text = TOK.render_chat(messages, add_generation_prompt=True)
    assert encode_chat_text(text, _encode, TOK.split_before, second).stem == 0
