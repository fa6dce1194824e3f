"""One attempt of a turn at an outside endpoint, relayed to the client.

Model of the world: the endpoint is an OpenAI-compatible API (only `outside_body` and its
key leave the box), or the Anthropic Messages API (the chat turn as a Messages request,
`anthropic_out.py`, its answer or event stream back as chat, `anthropic_back.py`). At most
`max_concurrent` of its attempts are in flight (`full` says when a turn must stay local). A
non-streamed answer is relayed as it came, parsed once for its usage and how it ended; a
stream is relayed chunk by chunk while its usage and tool calls are read in passing. An
endpoint that fails before its first byte (unreachable, an error status, silent for its
`timeout_s`) raises EngineError after its failed attempt is recorded: the caller sends the
turn back to the local box. One that breaks midway ends the stream with an error event and a
failed attempt. Every attempt is one `turns` row (endpoint, route reason, tokens as the
endpoint reports them, cost at its prices), and the client hears the turn is done only once
that row is committed, as for a local turn (services/turns/forwarder.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import orjson

from appliance.domain.errors import EngineError, LedgerError
from appliance.domain.records import TurnOutcome, TurnRecord
from appliance.policy.escalation import OutsidePrices, outside_cost
from appliance.ports import Clock, EngineClient
from appliance.services.escalation.anthropic_back import chat_answer, chat_stream
from appliance.services.escalation.anthropic_out import messages_body
from appliance.services.escalation.outside_body import outside_body
from appliance.services.sessions.answer_tools import ToolCallScanner
from appliance.services.turns.forwarder import SSE_DONE, UsageScanner, usage_in
from appliance.services.turns.turn import Reply, TurnRequest, cached_tokens, new_turn_id
from appliance.services.turns.turn_records import TurnRecords

CHAT_PATH = "/v1/chat/completions"
MESSAGES_PATH = "/v1/messages"


@dataclass(frozen=True)
class OutsideLink:
    """An outside endpoint as the relay uses it (built from its settings at start)."""

    name: str
    model: str
    client: EngineClient
    prices: OutsidePrices = field(default_factory=OutsidePrices)
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    """What is sent with every request besides the body: its key, nothing else."""
    max_concurrent: int = 8
    latency_s: float = 5.0
    kind: str = "openai"
    """openai (chat completions) or anthropic (Messages API: services/escalation/anthropic_*)."""
    """Its likely seconds to a first token (a spilled turn's deadline must allow it)."""


@dataclass
class _Attempt:
    reason: str
    started_at: float
    began: float = field(default_factory=time.monotonic)
    first_byte_s: float | None = None
    usage: dict[str, Any] = field(default_factory=dict)


class OutsideRelay:
    def __init__(self, link: OutsideLink, records: TurnRecords, clock: Clock) -> None:
        self.link = link
        self._records = records
        self._clock = clock
        self.in_flight = 0

    @property
    def full(self) -> bool:
        return self.in_flight >= self.link.max_concurrent

    def takes(self, path: str) -> bool:
        """Whether it serves the turn's route (the Messages API: chat turns only)."""
        return self.link.kind != "anthropic" or path == CHAT_PATH

    def _request(self, turn: TurnRequest) -> tuple[str, dict[str, Any]]:
        """The route and body the turn goes to the endpoint with."""
        if self.link.kind == "anthropic":
            return MESSAGES_PATH, messages_body(turn.body, self.link.model)
        return turn.path, outside_body(turn.body, self.link.model)

    async def send(self, turn: TurnRequest, reason: str) -> Reply:
        """The turn's answer (or the head of its stream) from the endpoint; raises
        EngineError, its failed attempt recorded, when it fails before its first byte."""
        attempt = _Attempt(reason, self._clock.now())
        path, body = self._request(turn)
        self.in_flight += 1
        streaming = False
        try:
            if turn.stream:
                reply = await self._stream(turn, path, body, attempt)
                streaming = True
                return reply
            answer = await self.link.client.post(path, body, self.link.headers)
            if self.link.kind == "anthropic":
                answer = chat_answer(answer)
            attempt.first_byte_s = time.monotonic() - attempt.began
            attempt.usage = usage_in(_parsed(answer)) or {}
            await asyncio.wrap_future(self._record(turn, attempt, TurnOutcome.OK))
            return Reply(200, self._headers(attempt), answer)
        except asyncio.CancelledError:
            self._record(turn, attempt, TurnOutcome.CANCELLED)
            raise
        except EngineError as exc:
            self._record(turn, attempt, TurnOutcome.FAILED, exc.message)
            raise
        finally:
            if not streaming:
                self.in_flight -= 1

    async def _stream(
        self, turn: TurnRequest, path: str, body: dict[str, Any], attempt: _Attempt
    ) -> Reply:
        stream = self.link.client.open_stream(path, body, headers=self.link.headers)
        response = await stream.__aenter__()
        chunks = response.chunks()
        pieces = (chat_stream(chunks) if self.link.kind == "anthropic" else chunks).__aiter__()
        try:
            first = await anext(pieces)
        except StopAsyncIteration:
            first = b""
        except BaseException:
            await stream.__aexit__(None, None, None)
            raise
        attempt.first_byte_s = time.monotonic() - attempt.began
        return Reply(
            200, self._headers(attempt), chunks=self._relay(turn, attempt, first, pieces, stream)
        )

    async def _relay(
        self,
        turn: TurnRequest,
        attempt: _Attempt,
        first: bytes,
        pieces: AsyncIterator[bytes],
        stream: Any,
    ) -> AsyncGenerator[bytes, None]:
        outcome, error, done = TurnOutcome.OK, None, b""
        usage, tools = UsageScanner(), ToolCallScanner()
        try:
            data = first
            while True:
                usage.feed(data)
                tools.feed(data)
                if data.endswith(SSE_DONE):
                    data, done = data[: -len(SSE_DONE)], SSE_DONE
                if data:
                    yield data
                try:
                    data = await anext(pieces)
                except StopAsyncIteration:
                    break
            attempt.usage = usage.last or {}
        except (GeneratorExit, asyncio.CancelledError):  # the client left midway
            outcome = TurnOutcome.CANCELLED
            raise
        except Exception as exc:  # the endpoint broke off midway
            outcome, error = TurnOutcome.FAILED, f"stream broke: {exc or type(exc).__name__}"
            event = {"error": {"message": error, "type": "stream_error", "code": 502}}
            yield b"data: " + orjson.dumps(event) + b"\n\n"
        finally:
            self.in_flight -= 1
            await stream.__aexit__(None, None, None)
            written = self._record(turn, attempt, outcome, error)
        try:
            await asyncio.wrap_future(written)
        except LedgerError as exc:  # answered, but not recorded: no [DONE]
            event = {"error": {"message": exc.message, "type": exc.code, "code": 503}}
            yield b"data: " + orjson.dumps(event) + b"\n\n"
            return
        if done:
            yield done

    def _headers(self, attempt: _Attempt) -> dict[str, str]:
        return {"X-Appliance-Endpoint": self.link.name}

    def _record(
        self, turn: TurnRequest, attempt: _Attempt, outcome: TurnOutcome, error: str | None = None
    ) -> Future[float | None]:
        """The attempt's turn row: the tokens the endpoint reported (an answer that reported
        none counts the prompt's own length), the cost at its prices."""
        usage = attempt.usage
        said = usage.get("prompt_tokens")
        prompt = (
            int(said) if said is not None else (turn.prompt_len if outcome is TurnOutcome.OK else 0)
        )
        cached = min(cached_tokens(usage) or 0, prompt)
        output = int(usage.get("completion_tokens") or 0)
        end = self._clock.now()
        record = TurnRecord(
            turn_id=new_turn_id(),
            tenant=turn.tenant,
            task_id=turn.task_id,
            session_id=turn.session_id,
            worker=None,
            model=self.link.model,
            prompt_tokens=prompt,
            cached_tokens=cached,
            output_tokens=output,
            outcome=outcome,
            started_at=attempt.started_at,
            finished_at=max(end, attempt.started_at),
            parent_task_id=turn.parent_task_id,
            ttft_s=attempt.first_byte_s,
            e2e_s=time.monotonic() - attempt.began,
            error=error,
            endpoint=self.link.name,
            route_reason=attempt.reason,
            priced_cost=outside_cost(
                self.link.prices, prompt_tokens=prompt, cached_tokens=cached, output_tokens=output
            ),
        )
        return self._records.outside(record)


def _parsed(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except ValueError:
        return None
