"""The forwarder: one attempt of a turn at one worker, relayed to the client.

A non-streamed answer is relayed as the worker's bytes; it is parsed once, for its `usage`
and for how it ended (`answer_tools.py`: the tools it called, or none). A stream is relayed
chunk by chunk as the worker sends it, unparsed, while `UsageScanner` finds the `usage` line
and `ToolCallScanner` the tool calls and finish reason in passing. The worker's first byte
tells the queue book the prefill is done. A worker that fails before the first byte raises
(EngineUnavailable, EngineTimedOut when it sent nothing for `engine.request_timeout_s`, or
EngineRequestError with its status) and the caller decides whether to retry; a stream that
breaks midway ends with an SSE error event and a failed attempt; a client that leaves a
stream midway ends the worker's request (its stream is closed) and leaves a cancelled
attempt. Every attempt ends in the queue book and in the turn records exactly once
(`finish`).

The client hears that a turn is done only once its turn row is committed: a non-streamed
answer is sent after the commit, and a stream's closing `data: [DONE]` is held back until
then (a row the ledger refuses makes the answer a 503 `ledger_unavailable`, or the stream's
end an error event). So a SIGKILL never takes from the ledger a turn a client was answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

import orjson

from appliance.domain.errors import EngineRequestError, EngineTimedOut, LedgerError
from appliance.domain.records import TurnOutcome
from appliance.ports import Clock, WorkerEndpoint
from appliance.services.sessions.answer_tools import ToolCallScanner, answer_end
from appliance.services.turns.queue_book import QueueBook
from appliance.services.turns.turn import Attempt, Reply, TurnRequest, cached_tokens
from appliance.services.turns.turn_records import TurnRecords


class Forwarder:
    def __init__(self, clock: Clock, queues: QueueBook, records: TurnRecords) -> None:
        self._clock = clock
        self._queues = queues
        self._records = records

    async def post(
        self,
        turn: TurnRequest,
        worker: WorkerEndpoint,
        attempt: Attempt,
        body: dict[str, Any],
        on_answer: Callable[[], None] | None = None,
    ) -> Reply:
        """A non-streamed attempt; raises as the module docstring says. `on_answer` runs
        once the worker has answered, before the attempt is finished."""
        answer = await worker.client.post(turn.path, body)
        if on_answer is not None:
            on_answer()
        attempt.first_byte_at = self._clock.now()
        doc = _parsed(answer)
        attempt.usage = usage_in(doc) or {}
        attempt.said = answer_end(doc)
        await asyncio.wrap_future(self.finish(turn, attempt, TurnOutcome.OK))  # refused: 503
        return Reply(200, headers(turn, attempt), answer)

    async def stream(
        self,
        turn: TurnRequest,
        worker: WorkerEndpoint,
        attempt: Attempt,
        body: dict[str, Any],
        on_end: Callable[[], None],
        *,
        stopped: Callable[[], TurnOutcome | None] = lambda: None,
    ) -> Reply:
        """A streamed attempt: raises before the worker's head; returns once its first
        chunk is in (a worker sends its head at once, its first chunk once the request has
        started: until then the turn waits on its worker, and cancelling this call aborts
        it there), or the stream ended or broke before any. The reply's chunks relay it,
        and however it ends `on_end` runs and the attempt is finished. Once `stopped()`
        (its task was cancelled or discarded: the outcome its attempt is recorded as), it ends
        at the next chunk with an error event."""
        stream = worker.client.open_stream(turn.path, body)
        response = await stream.__aenter__()
        try:
            source = await self._started(response.chunks().__aiter__(), attempt)
        except (asyncio.CancelledError, EngineTimedOut):
            await stream.__aexit__(None, None, None)  # closes the request: vLLM aborts it
            raise

        async def chunks() -> AsyncGenerator[bytes, None]:
            outcome, error = TurnOutcome.OK, None
            usage, tools = UsageScanner(), ToolCallScanner()
            done = b""  # the worker's closing `data: [DONE]`, sent once the turn is recorded
            try:
                async for data in source:  # relayed as they come, unparsed
                    if (ended := stopped()) is not None:
                        outcome = ended
                        yield b"data: " + orjson.dumps(_stopped_event(ended)) + b"\n\n"
                        break
                    usage.feed(data)
                    tools.feed(data)
                    attempt.chunks += 1
                    if data.endswith(SSE_DONE):
                        data, done = data[: -len(SSE_DONE)], SSE_DONE
                    if data:
                        yield data
                if usage.last:
                    attempt.usage = usage.last
                attempt.said = tools.end()  # before `on_end`: the reaper reads it then
            except (GeneratorExit, asyncio.CancelledError):  # the client left midway
                outcome = TurnOutcome.CANCELLED
                raise
            except Exception as exc:  # the worker broke off midway
                outcome, error = TurnOutcome.FAILED, f"stream broke: {exc or type(exc).__name__}"
                event = {"error": {"message": error, "type": "stream_error", "code": 502}}
                yield b"data: " + orjson.dumps(event) + b"\n\n"
            finally:
                on_end()
                await stream.__aexit__(None, None, None)
                written = self.finish(turn, attempt, outcome, error=error)
            if end := await _recorded_end(written, done):  # the client is still there
                yield end

        return Reply(200, headers(turn, attempt), chunks=chunks())

    async def _started(
        self, pieces: AsyncIterator[bytes], attempt: Attempt
    ) -> AsyncIterator[bytes]:
        """Waits for the stream's first chunk (the attempt's first byte): the stream's
        chunks from it on. One that ends or breaks first does so when relayed; one whose
        worker sends nothing for the request timeout raises (no byte has reached the client)."""
        try:
            first = await anext(pieces)
        except StopAsyncIteration:
            return pieces
        except EngineTimedOut:
            raise
        except Exception as exc:  # raised again where the relay reports it
            return _broken(exc)
        attempt.first_byte_at = self._clock.now()
        self._queues.first_byte(attempt.worker, attempt.turn_id)
        return _chained(first, pieces)

    def finish(
        self, turn: TurnRequest, attempt: Attempt, outcome: TurnOutcome, *, error: str | None = None
    ) -> Future[float | None]:
        """Ends the attempt, once (a client that leaves while its answer's row is being
        committed finds it ended); the write of its turn row."""
        if attempt.recorded is None:
            self._queues.ended(
                attempt.worker, attempt.turn_id, failed=outcome == TurnOutcome.FAILED
            )
            attempt.recorded = self._records.ended(turn, attempt, outcome, error, self._clock.now())
        return attempt.recorded


SSE_DONE = b"data: [DONE]\n\n"


async def _recorded_end(written: Future[Any], done: bytes) -> bytes:
    """A stream's last bytes, once its turn is recorded: the worker's `done` ([DONE], or
    nothing after a stop), or an error event when the ledger refused the row."""
    try:
        await asyncio.wrap_future(written)
    except LedgerError as exc:  # answered, but not recorded: no [DONE]
        event = {"error": {"message": exc.message, "type": exc.code, "code": exc.http_status}}
        return b"data: " + orjson.dumps(event) + b"\n\n"
    return done


def _stopped_event(outcome: TurnOutcome) -> dict[str, Any]:
    """The SSE error event that ends a stream its task's closing stopped."""
    if outcome is TurnOutcome.DISCARDED:
        message, kind = "the task's parent succeeded without it: discarded", "task_discarded"
    else:
        message, kind = "the task was cancelled", "task_cancelled"
    return {"error": {"message": message, "type": kind, "code": 409}}


def headers(turn: TurnRequest, attempt: Attempt) -> dict[str, str]:
    cached = cached_tokens(attempt.usage)
    return {
        "X-Appliance-Worker": attempt.worker,
        "X-Task-ID": turn.task_id,
        "X-Appliance-Cached-Tokens": str(
            cached if cached is not None else attempt.predicted_cached
        ),
    }


def error_reply(exc: EngineRequestError) -> Reply:
    """A worker's 4xx, relayed with its own error body where it has one."""
    try:
        body = orjson.loads(exc.body)
        if isinstance(body, dict) and "error" in body:
            return Reply(exc.http_status, {}, orjson.dumps(body))
    except (TypeError, ValueError):
        pass
    error = {"message": exc.message, "type": "BadRequestError", "code": exc.http_status}
    return Reply(exc.http_status, {}, orjson.dumps({"error": error}))


class UsageScanner:
    """Finds the `usage` of an SSE stream in the bytes relayed to the client, parsing only
    the complete `data:` lines that mention it (the last such line wins)."""

    def __init__(self) -> None:
        self._tail = b""
        self.last: dict[str, Any] | None = None

    def feed(self, data: bytes) -> None:
        buffer = self._tail + data
        end = buffer.rfind(b"\n") + 1
        complete, self._tail = buffer[:end], buffer[end:]
        if b'"usage"' not in complete:
            return
        for line in complete.split(b"\n"):
            if line.startswith(b"data:") and b'"usage"' in line:
                usage = usage_of(line[5:])
                if usage:
                    self.last = usage


def usage_of(data: bytes) -> dict[str, Any] | None:
    return usage_in(_parsed(data))


def _parsed(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except ValueError:
        return None


def usage_in(chunk: Any) -> dict[str, Any] | None:
    """The usage of a parsed answer or chunk, in the chat API's shape."""
    if isinstance(chunk, dict) and isinstance(chunk.get("response"), dict):
        chunk = chunk["response"]  # a Responses API event (`response.completed`)
    usage = chunk.get("usage") if isinstance(chunk, dict) else None
    if isinstance(usage, dict) and "input_tokens" in usage:  # the Responses API's shape
        details = usage.get("input_tokens_details") or {}
        return {
            "prompt_tokens": usage.get("input_tokens"),
            "completion_tokens": usage.get("output_tokens"),
            "total_tokens": usage.get("total_tokens"),
            "prompt_tokens_details": {"cached_tokens": details.get("cached_tokens")},
            "completion_tokens_details": usage.get("output_tokens_details"),
        }
    return usage if isinstance(usage, dict) else None


async def _chained(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for data in rest:
        yield data


async def _broken(exc: Exception) -> AsyncIterator[bytes]:
    raise exc
    yield b""  # an async generator that raises when iterated
