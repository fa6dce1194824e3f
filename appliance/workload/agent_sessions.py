"""Recorded agent sessions (`agent_traces.py`) as the chat requests a live benchmark sends:
each request's messages, its answer's length and whether the answer calls a tool.

Model of the world (the replay's, `replay/sessions/session_loop.py`, which this must match): a
request's `hash_ids` name its 64-token blocks, equal ids equal blocks, scoped to a run of a
session and its sub-agents (`scope`: two runs of the same recording share nothing). Here a
block is 64 words of text (`block_words`): one token each for the simulated engine's
tokenizer (the fallback: a word and the space before it), so equal ids give equal tokens
and a block is exactly one 64-token block; on a real tokenizer about one or two tokens a
word. As in the replay (upstream's `--warm-prefix-pct` 0.5), the first half of a session's
system prompt and tool schemas is the same text in every session: while a prompt's leading
ids are its session's first prompt's, the blocks among the first `warm` are keyed by their
position in a scope every session shares. The tokens past the last whole block (`in % 64`,
no id) are the start of the block that the session's next request has there, when that
request re-sends this prompt (an agent's next prompt appends the answer to it), else words
of their own.

Messages: a harness re-sends its chat and appends to it, and the router tokenises only what
was appended. So a session's first prompt is a system message (the warm blocks) and a user
message (the rest); each later prompt that re-sends all of the previous one is the same
messages plus one user message of what it adds (the rest of a split block, then new
blocks); one that re-sends less (the history was rewritten, compacted) keeps the messages
it re-sends whole and puts the rest in one new message. Message boundaries add the chat
template's tokens (6 a message in the fallback template), so a prompt is its `in` tokens
plus those; blocks and their sharing are the trace's.

Answers: the trace's `out` tokens. A request that ended in a tool call (`stop` "tool_use")
offers one tool whose only argument is a constant of `out - TOOL_CALL_TOKENS` words, so the
simulated engine's answer calls it (`sim/entrypoints/tool_calls.py`: with tools and `tool_choice`
auto it calls the tool) in exactly `out` tokens (at least `TOOL_CALL_TOKENS + 1`), and the
router reads a tool call from the answer, as the replay tells its residency policy; any
other request asks for `out` tokens of text (`ignore_eos`), which the router reads as a
wait on the person. No header hint is sent (the replay invents none).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance.workload.agent_traces import TraceRequest
from appliance.workload.text import WORDS

BLOCK_TOKENS = 64
"""Tokens per hash id in the kv-cache-tester sessions."""
WARM_PREFIX_SHARE = 0.5
"""Upstream's `--warm-prefix-pct` default, as the replay's."""
WARM_SCOPE = "warm"
TOOL_NAME = "run_tool"
TOOL_ARGUMENT = "output"
TOOL_CALL_TOKENS = 22
"""Tokens of the simulated engine's call of `TOOL_NAME` besides its argument's words (the
hermes block around them), in the fallback tokenizer (checked by the unit test)."""

Key = tuple[str, object]
"""A block's key: (scope, id) or (`WARM_SCOPE`, position)."""


def block_words(key: Key) -> tuple[str, ...]:
    """The block's 64 words, the same for the same key."""
    return tuple(random.Random(f"{key[0]}/{key[1]}").choices(WORDS, k=BLOCK_TOKENS))


def warm_blocks(system_tokens: int, tool_tokens: int) -> int:
    """Leading blocks of a session's first prompt that every session shares."""
    return int(WARM_PREFIX_SHARE * (system_tokens + tool_tokens)) // BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class LiveRequest:
    """One request as sent: its chat, how long its answer is, and whether it calls a tool."""

    messages: list[dict[str, str]]
    max_tokens: int
    tool_call: bool
    input_tokens: int
    """The trace's `in`: the messages' words (the chat template adds its own tokens)."""

    def body(self) -> dict[str, Any]:
        """The request's fields besides model, messages and stream."""
        if not self.tool_call:
            return {"max_tokens": self.max_tokens, "extra_body": {"ignore_eos": True}}
        n = self.max_tokens - TOOL_CALL_TOKENS
        words = block_words(("tool", n)) * (n // BLOCK_TOKENS + 1)
        argument = " ".join(words[:n])
        schema = {
            "type": "object",
            "properties": {TOOL_ARGUMENT: {"const": argument}},
            "required": [TOOL_ARGUMENT],
        }
        tool = {"type": "function", "function": {"name": TOOL_NAME, "parameters": schema}}
        return {"max_tokens": self.max_tokens, "tools": [tool], "tool_choice": "auto"}


@dataclass(slots=True)
class _Message:
    role: str
    content: str
    start: int
    """Its first word's offset in the prompt's words."""
    end: int


@dataclass(slots=True)
class SessionPrompts:
    """The requests of one agent (a session, or one of its sub-agents), in order: each
    `request(k)` after `request(k - 1)` (see the module)."""

    requests: Sequence[TraceRequest]
    """The requests it sends, in order (those skipped for the window left out)."""
    scope: str
    warm_ids: tuple[int, ...] = ()
    """Its session's first prompt's leading ids that every session shares (a sub-agent: none)."""
    _blocks: dict[Key, tuple[str, ...]] = field(default_factory=dict)
    _messages: list[_Message] = field(default_factory=list)
    _words: list[Key] = field(default_factory=list)
    """The previous prompt's blocks' keys, its tail's block last."""
    _n_words: int = 0

    def request(self, k: int) -> LiveRequest:
        step = self.requests[k]
        keys = self._keys(step)
        n_words = max(1, step.input_tokens)
        tail = self._tail_key(k, keys) if n_words % BLOCK_TOKENS else None
        all_keys = keys + ([tail] if tail is not None else [])
        warm = self._first_warm(keys)
        kept = [m for m in self._messages if m.end <= self._shared_words(keys)]
        if warm:
            kept.append(self._message("system", all_keys, 0, warm))
        start = kept[-1].end if kept else 0
        if start < n_words:
            kept.append(self._message("user", all_keys, start, n_words))
        self._messages, self._words, self._n_words = kept, all_keys, n_words
        out = max(1, step.output_tokens)
        tool_call = step.stop == "tool_use"
        return LiveRequest(
            messages=[{"role": m.role, "content": m.content} for m in kept],
            max_tokens=max(out, TOOL_CALL_TOKENS + 1) if tool_call else out,
            tool_call=tool_call,
            input_tokens=step.input_tokens,
        )

    def overflowing(self, step: TraceRequest) -> LiveRequest:
        """The request a harness sends for `step` where its prompt overflows the window (it
        is not among `requests`): the previous prompt's messages and one more of the words
        `step` adds to them, one token asked for."""
        n = max(1, step.input_tokens - self._n_words)
        words = block_words((self.scope, "overflow")) * (n // BLOCK_TOKENS + 1)
        messages = [{"role": m.role, "content": m.content} for m in self._messages]
        messages.append({"role": "user", "content": " ".join(words[:n])})
        return LiveRequest(messages, 1, False, step.input_tokens)

    def _keys(self, step: TraceRequest) -> list[Key]:
        """The keys of the prompt's whole blocks (the warm rule: see the module)."""
        ids = step.hash_ids[: step.input_tokens // BLOCK_TOKENS]
        warm = 0
        for a, b in zip(ids, self.warm_ids, strict=False):
            if a != b:
                break
            warm += 1
        return [(WARM_SCOPE, j) if j < warm else (self.scope, x) for j, x in enumerate(ids)]

    def _first_warm(self, keys: list[Key]) -> int:
        """Words of the warm blocks a first prompt puts in its system message (0: none)."""
        warm = sum(1 for k in keys if k[0] == WARM_SCOPE) * BLOCK_TOKENS
        return warm if not self._messages and 0 < warm < len(keys) * BLOCK_TOKENS else 0

    def _tail_key(self, k: int, keys: list[Key]) -> Key:
        """The block whose start the prompt's last words are (see the module)."""
        if k + 1 < len(self.requests):
            following = self._keys(self.requests[k + 1])
            if len(following) > len(keys) and following[: len(keys)] == keys:
                return following[len(keys)]
        return (self.scope, f"tail/{k}")

    def _shared_words(self, keys: list[Key]) -> int:
        """Leading words this prompt shares with the previous one."""
        prev = self._words
        n = 0
        for a, b in zip(prev, keys, strict=False):
            if a != b:
                break
            n += 1
        return min(n * BLOCK_TOKENS, self._n_words)

    def _message(self, role: str, keys: list[Key], start: int, end: int) -> _Message:
        words: list[str] = []
        for j in range(start // BLOCK_TOKENS, (end - 1) // BLOCK_TOKENS + 1):
            block = self._blocks.get(keys[j])
            if block is None:
                block = self._blocks[keys[j]] = block_words(keys[j])
            lo = max(start - j * BLOCK_TOKENS, 0)
            hi = min(end - j * BLOCK_TOKENS, BLOCK_TOKENS)
            words += block[lo:hi]
        return _Message(role, " ".join(words), start, end)
