"""The session of a turn that names none (services/sessions/session_finder.py), and the order
in which a turn's own ids name it (api/turns/requests.py `client_session`).

A chat turn whose messages extend an idle session's last prompt is that session's next
turn; a busy one is forked (a new session), two identical starts are two sessions, the
map holds one tip per session of the table and no more, and one tenant's (or model's)
conversation never finds another's."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any

import pytest

from appliance.api.errors import RequestRefused
from appliance.api.turns.requests import agent_headers, client_session
from appliance.domain.block_hash import BlockHasher, HashAlgo
from appliance.domain.records import RouteDecisionRecord, SessionId, TenantId, WorkerId
from appliance.services.sessions.session_finder import (
    MAX_CHAIN_MESSAGES,
    FoundSession,
    find_session,
    let_go,
    prompt_chain,
)
from appliance.services.sessions.sessions import SessionTable
from appliance.services.turns.turn import Reply, TurnRequest
from tests.fakes import AckLedger, FakeTurnTokenizer, ManualClock, RouterWorker, Wired, wired_desk

A, B = TenantId("alice"), TenantId("bob")
SYSTEM = {"role": "system", "content": "You are a coding agent."}
ANSWER = b'{"usage": {"prompt_tokens": 40, "completion_tokens": 1}}'


def grown(messages: list[Any], n: int) -> list[Any]:
    """`messages` and a tool loop's next step: the answer's tool call, its result, a nudge."""
    call = {"id": f"c{n}", "type": "function", "function": {"name": "grep", "arguments": "{}"}}
    return [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"c{n}", "content": f"{n} matches"},
        {"role": "user", "content": f"step {n}"},
    ]


START = [SYSTEM, {"role": "user", "content": "Please fix the bug."}]


# --- the finder over a session table -------------------------------------------------------


def table(max_sessions: int = 100) -> SessionTable:
    return SessionTable(BlockHasher(HashAlgo.SHA256_CBOR, 16), max_sessions=max_sessions)


def take(sessions: SessionTable, messages: list[Any], tenant: TenantId = A) -> FoundSession:
    """A turn found and begun, as the desk does (it stays in flight)."""
    found = find_session(sessions, tenant, "m", messages)
    assert found is not None
    state = sessions.open(tenant, found.session_id, 0.0)
    sessions.tip(state, found.tip)
    sessions.began(state, 0.0)
    let_go(sessions, found)
    return found


def end(sessions: SessionTable, found: FoundSession, tenant: TenantId = A) -> None:
    state = sessions.get(tenant, found.session_id)
    assert state is not None
    sessions.ended(state, 1.0)


def test_a_growing_conversation_is_one_session_whatever_its_answers_render_as() -> None:
    sessions, messages = table(), START
    first = take(sessions, messages)
    assert first.session_id.startswith("chain-") and first.claimed is None
    assert first.note == "new session (no id, no prefix match)"
    end(sessions, first)
    for n in range(5):
        messages = grown(messages, n)
        found = take(sessions, messages)
        assert found.session_id == first.session_id, found.note
        assert found.note.startswith("session from prefix chain")
        end(sessions, found)
    # The same turn again (a retry of a failed one) is the same session too.
    assert take(sessions, messages).session_id == first.session_id


def test_a_turn_that_extends_a_busy_session_forks_a_new_one() -> None:
    sessions = table()
    first = take(sessions, START)  # in flight
    fork = take(sessions, grown(START, 1))
    assert fork.session_id != first.session_id
    assert fork.note == f"new session (forks {first.session_id}, which has a turn in flight)"
    end(sessions, first)
    end(sessions, fork)
    # Both idle now: each line goes on with its own session.
    assert take(sessions, grown(START, 2)).session_id == first.session_id
    assert take(sessions, grown(grown(START, 1), 3)).session_id == fork.session_id


def test_two_identical_starts_are_two_sessions_and_each_goes_on() -> None:
    sessions = table()
    one, two = take(sessions, START), take(sessions, START)
    assert one.session_id != two.session_id
    end(sessions, one)
    end(sessions, two)
    # Two runs of the same task, each at its next step: two sessions, not one.
    next_one, next_two = take(sessions, grown(START, 1)), take(sessions, grown(START, 2))
    assert {next_one.session_id, next_two.session_id} == {one.session_id, two.session_id}
    # A third, with both busy: a third session.
    assert take(sessions, grown(START, 3)).session_id not in {one.session_id, two.session_id}


def test_a_claimed_session_is_nobody_elses_until_its_turn_lets_it_go() -> None:
    sessions = table()
    end(sessions, first := take(sessions, START))
    claim = find_session(sessions, A, "m", grown(START, 1))
    assert claim is not None and claim.session_id == first.session_id
    other = find_session(sessions, A, "m", grown(START, 2))  # before the first began
    assert other is not None and other.session_id != first.session_id
    let_go(sessions, claim)  # the claiming turn failed before it began (refused, say)
    again = find_session(sessions, A, "m", grown(START, 2))
    assert again is not None and again.session_id == first.session_id


def test_the_map_holds_one_tip_per_session_of_the_table_and_no_more() -> None:
    sessions = table(max_sessions=10)
    for n in range(50):  # 50 conversations, each its own
        end(sessions, take(sessions, [SYSTEM, {"role": "user", "content": f"task {n}"}]))
    assert len(sessions) == 10
    assert sum(len(h) for h in sessions._tips.values()) == 10
    # A conversation whose session the table let go starts a new one.
    gone = [SYSTEM, {"role": "user", "content": "task 0"}]
    assert take(sessions, grown(gone, 1)).note == "new session (no id, no prefix match)"
    # A session's task closing drops its tip with it.
    state = next(iter(sessions))
    sessions.bind_task(state, "t/1")  # type: ignore[arg-type]
    sessions.forget_task("t/1")  # type: ignore[arg-type]
    assert state.prompt_tip is None
    assert sum(len(h) for h in sessions._tips.values()) == len(sessions)


def test_a_tenants_conversation_never_finds_another_tenants_session() -> None:
    sessions = table()
    end(sessions, alice := take(sessions, START, A))
    bob = take(sessions, grown(START, 1), B)
    assert bob.session_id != alice.session_id and bob.note.startswith("new session")
    assert prompt_chain(A, "m", START) != prompt_chain(B, "m", START)
    assert prompt_chain(A, "m", START) != prompt_chain(A, "other-model", START)


def test_the_chain_reads_messages_not_their_spelling() -> None:
    spelled = [{"content": "Please fix the bug.", "role": "user", "name": None}]
    assert prompt_chain(A, "m", spelled) == prompt_chain(A, "m", START[1:])
    assert prompt_chain(A, "m", [{"role": "user", "content": "x"}]) != prompt_chain(
        A, "m", [{"role": "user", "content": "y"}]
    )
    assert len(prompt_chain(A, "m", [{"role": "user", "content": 2**70}])) == 1
    assert find_session(table(), A, "m", []) is None
    assert find_session(table(), A, "m", [{}] * (MAX_CHAIN_MESSAGES + 1)) is None


# --- through the desk ----------------------------------------------------------------------


class Decisions(AckLedger):
    def __init__(self) -> None:
        super().__init__()
        self.decisions: list[RouteDecisionRecord] = []

    def record_route_decision(self, record: RouteDecisionRecord) -> Future[Any]:
        self.decisions.append(record)
        done: Future[Any] = Future()
        done.set_result(None)
        return done


class Gate:
    """A worker that answers once `go` is set."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.go.set()

    async def post(self, path: str, body: Any, headers: Any = None) -> bytes:
        await self.go.wait()
        return ANSWER


def chat(messages: list[Any], *, bad: bool = False, **kw: Any) -> TurnRequest:
    body = {"model": "m", "messages": messages, **({"bad": True} if bad else {})}
    return TurnRequest(A, "/v1/chat/completions", body, conversation=messages, **kw)


def prompt_ids(turn: TurnRequest) -> list[int]:
    """A chat's ids as the tests' tokenizer makes them; a `bad` one cannot be tokenised."""
    if turn.body.get("bad"):
        raise RequestRefused(400, "bad", "invalid_value")
    return [1] * (40 + 8 * len(turn.body["messages"]))


def desk(gate: Gate) -> Wired:
    return wired_desk(
        [RouterWorker(WorkerId("w0"), gate)],
        clock=ManualClock(100.0),
        ledger=Decisions(),
        tokenizer=FakeTurnTokenizer(prompt_ids),
    )


def test_a_headerless_tool_loop_through_the_desk_is_one_session_and_says_so() -> None:
    async def loop() -> tuple[list[Reply], Wired]:
        wired, messages, replies = desk(Gate()), START, []
        for n in range(5):
            replies.append(await wired.desk.run(chat(messages)))
            messages = grown(messages, n)
        # A refused turn (it never began) leaves its session to the next one.
        with pytest.raises(RequestRefused):
            await wired.desk.run(chat(messages, bad=True))
        replies.append(await wired.desk.run(chat(messages)))
        return replies, wired

    replies, wired = asyncio.run(loop())
    sessions = {r.session_id for r in replies}
    assert len(sessions) == 1 and next(iter(sessions)).startswith("chain-")  # type: ignore[union-attr]
    assert {t.session_id for t in wired.ledger.turns} == sessions
    reasons = [d.reason for d in wired.ledger.decisions]
    assert "new session (no id, no prefix match)" in reasons[0]
    assert all("session from prefix chain" in r for r in reasons[1:]), reasons
    assert len(wired.desk.sessions) == 1


def test_turns_that_name_their_session_or_task_are_not_chained() -> None:
    async def two() -> list[Reply]:
        wired = desk(Gate())
        named = await wired.desk.run(chat(START, session_id=SessionId("mine")))
        tasked = await wired.desk.run(chat(grown(START, 1), client_task_id="job"))
        return [named, tasked]

    named, tasked = asyncio.run(two())
    assert (named.session_id, tasked.session_id) == ("mine", None)


def test_two_identical_starts_at_once_through_the_desk_are_two_sessions() -> None:
    async def race() -> list[Reply]:
        gate = Gate()
        gate.go.clear()
        wired = desk(gate)
        runs = [asyncio.ensure_future(wired.desk.run(chat(START))) for _ in range(2)]
        await asyncio.sleep(0.01)
        gate.go.set()
        return list(await asyncio.gather(*runs))

    one, two = asyncio.run(race())
    assert one.session_id != two.session_id


# --- the ids a turn names itself -----------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        ({"x-session-id": "s1", "x-claude-code-session-id": "cc"}, {}, ("s1", "X-Session-ID")),
        ({"x-claude-code-session-id": "cc"}, {"session_id": "b"}, ("b", "body session_id")),
        (
            {"x-claude-code-session-id": "cc", "session_id": "cx"},
            {},
            ("cc", "X-Claude-Code-Session-Id"),
        ),
        ({"session_id": "cx"}, {"prompt_cache_key": "k"}, ("cx", "session_id")),
        ({"session-id": "cx2"}, {}, ("cx2", "session-id")),
        ({}, {"prompt_cache_key": "k"}, ("k", "prompt_cache_key")),
        ({}, {}, None),
    ],
)
def test_a_turn_names_its_session_in_this_order(
    headers: dict[str, str], body: dict[str, Any], expected: tuple[str, str] | None
) -> None:
    named = client_session(headers, body)
    assert named == (expected and (expected[0], f"session from {expected[1]}"))
    hdr = agent_headers(headers, body)
    assert (hdr.session_id, hdr.session_note) == (named or (None, None))


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        ({"x-claude-code-session-id": "x" * 257}, {}),
        ({"session_id": "a\x00b"}, {}),
        ({}, {"prompt_cache_key": "k" * 257}),
        ({}, {"prompt_cache_key": 7}),
    ],
)
def test_every_id_a_turn_names_is_bounded(headers: dict[str, str], body: dict[str, Any]) -> None:
    with pytest.raises(RequestRefused) as refused:
        client_session(headers, body)
    assert refused.value.http_status == 400
