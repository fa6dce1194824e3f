"""What a model's answer ended in: calls of named tools, or a wait on the person.

Model of the world: an agent harness sends a model request, gets an answer, and when the
answer ends in tool calls runs them and sends the next request with their results; when it
ends otherwise (done, or cut at its length) the turn goes back to a person, whose reply is
the next request, if any. The answer says which, in every API the appliance serves, as it
passes through the forwarder (the one place every worker answer does):

- chat (and the Messages API, which the appliance sends to the worker as chat):
  `choices[0].message.tool_calls[].function.name`, and `choices[0].finish_reason`;
  streamed, the same in the chunks' `choices[0].delta.tool_calls[].function.name` (the
  first delta of each call) and the `finish_reason` of the last;
- the Responses API: the `function_call` items of `output` (their `name`) and `status`;
  streamed, the `response` of the `response.completed` (or `.incomplete`) event;
- completions: `choices[0].finish_reason` (text only: a wait on the person).

An answer with tool calls ends in them, whatever its finish reason (vLLM's is "stop" for a
named `tool_choice`); one without, whose finish reason (or status) says it is complete, waits
on the person; anything else (no finish reason: an error body, a stream cut short) says
nothing. Tool names are the client's (its tool schemas) or the model's: each is kept to
`TOOL_NAME_CHARS` characters of `[A-Za-z0-9_.:-]` (others become `_`; a longer one is cut,
with a digest of the whole), at most `MAX_CALLS` names an answer, and the set's class (the
names sorted, joined with "+") is held to the same length.

A stream is read in passing (`ToolCallScanner`): only complete `data:` lines that may say
something (a name, a finish reason that is not null, the Responses API's last event) are
parsed, so a long answer of text costs a byte search per chunk.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from appliance.policy.survival import MAX_CLASS_LEN, PERSON

TOOL_NAME_CHARS = MAX_CLASS_LEN
"""Longest tool name (and tool class) kept: the survival model's limit on a class, and
the OpenAI and Anthropic APIs' own on a tool's name (64)."""
MAX_CALLS = 16
"""Distinct tool names read from one answer; more calls add none (a class of 16 names is
already cut to `TOOL_NAME_CHARS` with its digest)."""
JOIN = "+"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:\-]")
_DIGEST_CHARS = 8
_COMPLETE = frozenset({"completed", "incomplete"})
"""The Responses API's statuses of an answer that is whole (cut at its length or not)."""
_MAY_SAY = re.compile(rb'"name"|"finish_reason"\s*:\s*"|"response\.(?:completed|incomplete)"')


@dataclass(frozen=True, slots=True)
class AnswerEnd:
    """How an answer ended: in calls of `tools` (names, bounded, distinct, sorted; empty for
    calls whose names were not read), or, `tool_call` False, with the turn back to a person."""

    tool_call: bool
    tools: tuple[str, ...] = ()

    @property
    def tool_class(self) -> str | None:
        """What its wait is keyed by: the names joined (bounded), `PERSON`, or None (a tool
        call of no name read)."""
        if not self.tool_call:
            return PERSON
        joined = JOIN.join(self.tools)
        return _shortened(joined, joined) if self.tools else None


TO_PERSON = AnswerEnd(tool_call=False)


def bounded(name: str) -> str:
    """`name` in safe characters, at most `TOOL_NAME_CHARS` of them (a longer one keeps its
    start and a digest of the whole, so two long names stay apart)."""
    return _shortened(_UNSAFE.sub("_", name), name)


def _shortened(text: str, whole: str) -> str:
    if len(text) <= TOOL_NAME_CHARS:
        return text
    digest = hashlib.blake2b(whole.encode(), digest_size=_DIGEST_CHARS // 2).hexdigest()
    return f"{text[: TOOL_NAME_CHARS - _DIGEST_CHARS - 1]}~{digest}"


def tool_calls(names: Iterable[Any]) -> AnswerEnd:
    """An answer ending in calls of the tools `names` (non-strings and empty ones ignored)."""
    kept: set[str] = set()
    keep_names(kept, names)
    return AnswerEnd(True, tuple(sorted(kept)))


def keep_names(kept: set[str], names: Iterable[Any]) -> None:
    """Adds the tool names among `names` to `kept`, bounded, while it has under `MAX_CALLS`."""
    for name in names:
        if isinstance(name, str) and name and len(kept) < MAX_CALLS:
            kept.add(bounded(name))


def answer_end(doc: Any) -> AnswerEnd | None:
    """How a parsed non-streamed answer (chat, completion or Responses) ended; None when it
    does not say (see the module)."""
    if not isinstance(doc, dict):
        return None
    if doc.get("object") == "response":
        return _response_end(doc)
    choice = _first_choice(doc)
    message = choice.get("message")
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if isinstance(calls, list) and calls:
        return tool_calls(_function_name(c) for c in calls)
    if choice.get("finish_reason") == "tool_calls":
        return AnswerEnd(True)
    return TO_PERSON if isinstance(choice.get("finish_reason"), str) else None


def _response_end(response: dict[str, Any]) -> AnswerEnd | None:
    output = response.get("output")
    items = [i for i in output if isinstance(i, dict)] if isinstance(output, list) else []
    calls = [i for i in items if i.get("type") == "function_call"]
    if calls:
        return tool_calls(i.get("name") for i in calls)
    return TO_PERSON if response.get("status") in _COMPLETE else None


def _first_choice(doc: dict[str, Any]) -> dict[str, Any]:
    choices = doc.get("choices")
    if not isinstance(choices, list):
        return {}
    first = next((c for c in choices if isinstance(c, dict) and c.get("index", 0) == 0), None)
    return first or {}


def _function_name(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    return function.get("name") if isinstance(function, dict) else None


class ToolCallScanner:
    """Reads how a streamed answer ended from the bytes relayed to the client (chat chunks,
    or the Responses API's events), parsing only the complete `data:` lines that may say."""

    def __init__(self) -> None:
        self._tail = b""
        self._names: set[str] = set()
        self._finish: str | None = None
        self._response: AnswerEnd | None = None

    def feed(self, data: bytes) -> None:
        buffer = self._tail + data
        end = buffer.rfind(b"\n") + 1
        complete, self._tail = buffer[:end], buffer[end:]
        if not _MAY_SAY.search(complete):
            return
        for line in complete.split(b"\n"):
            if line.startswith(b"data:") and _MAY_SAY.search(line):
                self._read(line[5:])

    def _read(self, data: bytes) -> None:
        try:
            event = orjson.loads(data)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        if event.get("type") in ("response.completed", "response.incomplete"):
            response = event.get("response")
            self._response = _response_end(response) if isinstance(response, dict) else None
            return
        choice = _first_choice(event)
        delta = choice.get("delta")
        calls = delta.get("tool_calls") if isinstance(delta, dict) else None
        if isinstance(calls, list):
            keep_names(self._names, (_function_name(c) for c in calls))
        if isinstance(choice.get("finish_reason"), str):
            self._finish = choice["finish_reason"]

    def end(self) -> AnswerEnd | None:
        """How the stream ended, once it has: None while no finish reason (or last
        Responses event) was seen."""
        if self._response is not None:
            return self._response
        if self._finish is None:
            return None
        if self._names or self._finish == "tool_calls":
            return AnswerEnd(True, tuple(sorted(self._names)))
        return TO_PERSON
