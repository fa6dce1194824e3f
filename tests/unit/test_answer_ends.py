"""How a turn's answer ended reaches its session by the time the session's turn ends, where
the idle reaper reads it: from a non-streamed answer, and from a stream once it has ended
(the chat shape serves the chat and Messages routes; the Responses API's its own route)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest

from appliance.domain.records import SessionId, TaskId, TenantId, WorkerId
from appliance.services.sessions.answer_tools import TO_PERSON, AnswerEnd
from appliance.services.sessions.sessions import TurnBegan, TurnEnded
from appliance.services.turns.turn import TurnRequest
from tests.fakes import RouterWorker, wired_desk
from tests.unit.test_answer_tools import chat, chat_stream, response


class Answers:
    """A worker that answers `answer` (a body, or a stream's bytes in pieces of 5)."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer

    async def post(self, path: str, body: Any, headers: Any = None) -> bytes:
        return self.answer

    @asynccontextmanager
    async def open_stream(self, path: str, body: Any) -> AsyncIterator[Any]:
        data = self.answer

        class Response:
            async def chunks(self) -> AsyncIterator[bytes]:
                for at in range(0, len(data), 5):
                    yield data[at : at + 5]

        yield Response()


class Ends:
    """The session table's subscriber: what each session's answer said as its turn ended."""

    def __init__(self) -> None:
        self.said: list[AnswerEnd | None] = []
        self.began = 0

    def turn_began(self, event: TurnBegan) -> None:
        self.began += 1
        assert event.session.said is None  # a new turn: the last answer's end is history

    def turn_ended(self, event: TurnEnded) -> None:
        self.said.append(event.session.said)


def run_turn(answer: bytes, *, stream: bool, path: str = "/v1/chat/completions") -> Ends:
    ends = Ends()
    wired = wired_desk([RouterWorker(WorkerId("w0"), Answers(answer))], subscribers=(ends,))
    body = {"model": "m", "stream": stream}
    turn = TurnRequest(TenantId("a"), path, body, list(range(40)), TaskId("a/t"), SessionId("s"))

    async def main() -> None:
        for _ in range(2):  # a second turn of the session starts from nothing said
            reply = await wired.desk.handle(turn)
            if reply.chunks is not None:
                assert len(ends.said) == ends.began - 1  # its turn ends with the stream
                _ = [c async for c in reply.chunks]
            for _ in range(3):
                await asyncio.sleep(0)

    asyncio.run(main())
    assert ends.began == 2
    return ends


GREP_READ = AnswerEnd(True, ("grep", "read_file"))


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (chat("tool_calls", "read_file", "grep"), GREP_READ),
        (chat("stop", content="done"), TO_PERSON),
        (chat("length", content="cut"), TO_PERSON),
        ({"error": {"message": "no"}}, None),
    ],
    ids=["tool_calls", "stop", "length", "error"],
)
def test_a_non_streamed_answers_end_reaches_its_session(answer: Any, said: Any) -> None:
    assert run_turn(orjson.dumps(answer), stream=False).said == [said, said]


@pytest.mark.parametrize(
    ("stream", "said"),
    [
        (chat_stream("tool_calls", "read_file", "grep"), GREP_READ),
        (chat_stream("stop", text="all done"), TO_PERSON),
    ],
    ids=["tool_calls", "stop"],
)
def test_a_streamed_answers_end_reaches_its_session_when_it_ends(stream: bytes, said: Any) -> None:
    assert run_turn(stream, stream=True).said == [said, said]


def test_a_responses_answer_ends_reach_its_session_streamed_or_not() -> None:
    body = response("completed", {"type": "function_call", "name": "shell", "arguments": "{}"})
    shell = AnswerEnd(True, ("shell",))
    assert run_turn(orjson.dumps(body), stream=False, path="/v1/responses").said == [shell] * 2
    event = {"type": "response.completed", "response": body}
    sse = b"event: response.completed\ndata: " + orjson.dumps(event) + b"\n\n"
    assert run_turn(sse, stream=True, path="/v1/responses").said == [shell] * 2
