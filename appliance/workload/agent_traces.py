"""Real coding-agent sessions: kv-cache-tester's Claude Code traces, one record a session.

Model of the world (shared/traces/README.md, section claude_code_kvct, checked against the
471 files): a session is one person's Claude Code conversation, one JSON object a file
(`trace_NNNN.json`, upstream gzip-compressed as `.json.gz`). Its steps, in file order, are
requests and sub-agent starts. A request is one call to the model: it starts `t` s after
the session's first, sends `in` tokens and gets `out` back, and ends in a tool call (`stop`
"tool_use": the next request follows the tool's result), in an answer to the person
("end_turn"), or where the recorder saw no end (`stop` "", here None). Its `think_time` is
the wait from the previous request's answer to it: the tool's run or the person's reply, 0
for the first. Where a file has none (71 of 31,879 requests, each after one without
`api_time`), the reader takes the gap from the previous request's start, as kv-cache-tester
does, less that request's `api_time` where known.

A prompt is its `hash_ids`: one id per whole block of `block_size` (64) tokens, so
len(hash_ids) is `in // block_size` (the tokens past the last whole block have no id);
equal ids are equal blocks, and a request whose ids begin with an earlier one's re-sends
that prefix. With `hash_id_scope` "local" the ids count from 1 in each session: the same id
in two sessions is not the same block, so a replay keys blocks by session.

A sub-agent entry (`type` "subagent") is an agent that the parent's previous answer started,
with its own system prompt, tools and requests (`t` from its own start, the first
`think_time` 0). Consecutive entries were started together, by one answer (their starts
agree within a second), and are one step here, `TraceSubagents`. The parent waits for them
(`status` "completed": the entry's `t` is the parent's time at which it ended,
`duration_ms` after it started) unless they ran in the background ("async_launched": `t`
is the start, no duration, and the parent goes on). Either way the parent's next
`think_time` counts from the answer that started them, so it includes their run. Sub-agents
share no block with their parent but their prefix with each other; none starts one of its
own (the reader refuses that). kv-cache-tester replays each sub-agent as a user of its own,
started when the parent reaches the entry, and holds the parent until all of them ended,
background ones too; it drops a session whose first request is over `--max-context`
(default 128,000) and ends one at its first request over it. The reader keeps everything:
what to replay is the replay's choice.
"""

from __future__ import annotations

import gzip
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import orjson

MAX_FILE_BYTES = 256 * 2**20
"""A session file's bound, uncompressed (the largest of the 471 is 4.2 MB)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request to the model."""

    t_s: float
    """Its start, s from its session's first request (a sub-agent's: from its own first)."""
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    stop: str | None
    """"tool_use", "end_turn"; None where the recorder saw no end."""
    think_time_s: float
    """From the previous request's answer to this request; 0 for the first."""
    api_time_s: float | None
    """How long the recorded API took to answer; None where not recorded."""
    model: str = ""

    @property
    def ends_in_tool_call(self) -> bool:
        return self.stop == "tool_use"

    def fits(self, max_model_len: int) -> bool:
        """Whether its prompt and output fit a model's window (else a replay skips it)."""
        return self.input_tokens + self.output_tokens <= max_model_len

    def overflows(self, max_model_len: int) -> bool:
        """Whether its prompt alone leaves a model's window no room for one output token
        (a server refuses it; its harness must compact)."""
        return self.input_tokens + 1 > max_model_len


@dataclass(frozen=True, slots=True)
class SubagentTrace:
    """One sub-agent: an entry of `type` "subagent"."""

    agent_id: str
    agent_type: str | None
    """`subagent_type`: "Explore", "Plan", "general-purpose"."""
    status: str | None
    """"completed" (the parent waited for it) or "async_launched" (it ran in the background)."""
    t_s: float
    """The entry's `t`, in the parent's time: its end if the parent waited, else its start."""
    duration_s: float | None
    system_tokens: int
    tool_tokens: int
    requests: tuple[TraceRequest, ...]

    @property
    def parent_waits(self) -> bool:
        return self.status != "async_launched"

    @property
    def start_s(self) -> float:
        """When the parent started it, in the parent's time."""
        if self.parent_waits and self.duration_s is not None:
            return self.t_s - self.duration_s
        return self.t_s


@dataclass(frozen=True, slots=True)
class TraceSubagents:
    """The sub-agents that one answer of the parent started together (consecutive entries)."""

    agents: tuple[SubagentTrace, ...]

    @property
    def parent_waits(self) -> bool:
        """The parent's next request waits for their end (for those it waits for)."""
        return any(a.parent_waits for a in self.agents)

    def requests(self) -> Iterator[TraceRequest]:
        for agent in self.agents:
            yield from agent.requests


@dataclass(frozen=True, slots=True)
class AgentSessionTrace:
    """One session: its requests and sub-agent starts in file order."""

    session_id: str
    block_size: int
    hash_id_scope: str
    """"local" (also where the file says nothing): ids scoped to the session and its sub-agents."""
    system_tokens: int
    tool_tokens: int
    steps: tuple[TraceRequest | TraceSubagents, ...]

    def requests(self) -> Iterator[TraceRequest]:
        """Every request, the sub-agents' included, in file order (one sub-agent's after
        another's)."""
        for step in self.steps:
            if isinstance(step, TraceSubagents):
                yield from step.requests()
            else:
                yield step

    def own_requests(self) -> tuple[TraceRequest, ...]:
        """The session's own requests, without its sub-agents'."""
        return tuple(s for s in self.steps if isinstance(s, TraceRequest))

    def subagent_steps(self) -> tuple[TraceSubagents, ...]:
        return tuple(s for s in self.steps if isinstance(s, TraceSubagents))

    @property
    def max_input_tokens(self) -> int:
        return max((r.input_tokens for r in self.requests()), default=0)


def read_agent_sessions(path: str | Path) -> list[AgentSessionTrace]:
    """The sessions of one file, or of a folder's `*.json` and `*.json.gz` files, sorted by
    name (other files, and statistics: `stats.json`, `*.stats.json`, ignored). Bad input
    raises ValueError naming the file and the fault."""
    return [_read_session(p) for p in _session_files(Path(path))]


def _session_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"{path}: no such file or folder")
    files = sorted((p for p in path.iterdir() if _is_session_file(p)), key=lambda p: p.name)
    if not files:
        raise ValueError(f"{path}: the folder holds no session file (*.json, *.json.gz)")
    return files


def _is_session_file(path: Path) -> bool:
    """Statistics beside the sessions (`stats.json`, `*.stats.json`) are not sessions."""
    name = path.name.removesuffix(".gz")
    return (
        path.is_file()
        and name.endswith(".json")
        and name != "stats.json"
        and not name.endswith(".stats.json")
    )


def _read_session(path: Path) -> AgentSessionTrace:
    try:
        return _session(_load(path), path)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _load(path: Path) -> object:
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        else:
            with path.open("rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"cannot read it ({e})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES:,} bytes uncompressed: not read")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e})") from None


def _session(data: object, path: Path) -> AgentSessionTrace:
    if not isinstance(data, dict):
        raise ValueError("not a JSON object (one session a file)")
    raw = data.get("requests")
    if not isinstance(raw, list):
        raise ValueError("no `requests` list")
    if not raw:
        raise ValueError("`requests` is empty")
    block = _count(data, "block_size", "the session", default=64)
    if block == 0:
        raise ValueError("`block_size` is 0")
    return AgentSessionTrace(
        session_id=_text(data, "id", "the session") or path.name.split(".")[0],
        block_size=block,
        hash_id_scope=_text(data, "hash_id_scope", "the session") or "local",
        system_tokens=_count(data, "system_tokens", "the session", default=0),
        tool_tokens=_count(data, "tool_tokens", "the session", default=0),
        steps=_steps(raw, block),
    )


def _steps(raw: list[object], block: int) -> tuple[TraceRequest | TraceSubagents, ...]:
    steps: list[TraceRequest | TraceSubagents] = []
    started: list[SubagentTrace] = []
    chain = _Chain(block)
    for i, entry in enumerate(raw):
        where = f"requests[{i}]"
        if isinstance(entry, dict) and entry.get("type") == "subagent":
            started.append(_subagent(entry, block, where))
            continue
        if started:
            steps.append(TraceSubagents(tuple(started)))
            started = []
        steps.append(chain.request(entry, where))
    if started:
        steps.append(TraceSubagents(tuple(started)))
    return tuple(steps)


def _subagent(entry: dict[str, Any], block: int, where: str) -> SubagentTrace:
    raw = entry.get("requests")
    if not isinstance(raw, list):
        raise ValueError(f"{where}: a sub-agent without a `requests` list")
    chain = _Chain(block)
    requests = []
    for j, r in enumerate(raw):
        inner = f"{where}.requests[{j}]"
        if isinstance(r, dict) and r.get("type") == "subagent":
            raise ValueError(f"{inner}: a sub-agent inside a sub-agent (not supported)")
        requests.append(chain.request(r, inner))
    duration_ms = _opt_seconds(entry, "duration_ms", where)
    return SubagentTrace(
        agent_id=_text(entry, "agent_id", where) or where,
        agent_type=_text(entry, "subagent_type", where),
        status=_text(entry, "status", where),
        t_s=_seconds(entry, "t", where),
        duration_s=None if duration_ms is None else duration_ms / 1000,
        system_tokens=_count(entry, "system_tokens", where, default=0),
        tool_tokens=_count(entry, "tool_tokens", where, default=0),
        requests=tuple(requests),
    )


class _Chain:
    """One agent's requests in order. A request that re-sends its previous one's prompt
    shares that tuple's id objects (the 471 sessions hold 61 M ids, 2.2 M of them distinct
    within their session), and only its new ids are checked."""

    __slots__ = ("block", "prev", "prev_raw")

    def __init__(self, block: int) -> None:
        self.block = block
        self.prev: TraceRequest | None = None
        self.prev_raw: list[object] = []

    def request(self, entry: object, where: str) -> TraceRequest:
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: not a JSON object")
        t = _seconds(entry, "t", where)
        n_in = _count(entry, "in", where)
        think = _opt_seconds(entry, "think_time", where)
        api = _opt_seconds(entry, "api_time", where)
        stop = _text(entry, "stop", where)
        prev = self.prev
        if prev is not None and t < prev.t_s:
            raise ValueError(
                f"{where}: starts at {t} s, before the request above it ({prev.t_s} s)"
            )
        if think is None:
            think = 0.0 if prev is None else max(0.0, t - prev.t_s - (prev.api_time_s or 0.0))
        request = TraceRequest(
            t_s=float(t),
            input_tokens=n_in,
            output_tokens=_count(entry, "out", where),
            hash_ids=self._hash_ids(entry.get("hash_ids"), n_in, where),
            stop=stop or None,
            think_time_s=float(think),
            api_time_s=None if api is None else float(api),
            model=_text(entry, "model", where) or "",
        )
        self.prev = request
        return request

    def _hash_ids(self, raw: object, n_in: int, where: str) -> tuple[int, ...]:
        if not isinstance(raw, list):
            raise ValueError(f"{where}: `hash_ids` missing or not a list")
        whole, part = divmod(n_in, self.block)
        if len(raw) not in (whole, whole + (part > 0)):
            raise ValueError(
                f"{where}: {len(raw)} hash ids for {n_in} tokens "
                f"(one per whole {self.block}-token block: {whole})"
            )
        before = self.prev.hash_ids if self.prev is not None else ()
        n = len(before)
        if n and len(raw) >= n and raw[:n] == self.prev_raw:
            ids = before + _checked_ids(raw[n:], where)
        else:
            ids = _checked_ids(raw, where)
        self.prev_raw = raw
        return ids


def _checked_ids(raw: list[object], where: str) -> tuple[int, ...]:
    for h in raw:
        if type(h) is not int or h < 0:
            raise ValueError(f"{where}: hash id {h!r} is not a whole number >= 0")
    return cast("tuple[int, ...]", tuple(raw))


def _count(obj: dict[str, Any], key: str, where: str, *, default: int | None = None) -> int:
    value = obj.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"{where}: no `{key}`")
        return default
    if type(value) is not int or value < 0:
        raise ValueError(f"{where}: `{key}` is {value!r}, not a whole number >= 0")
    return value


def _opt_seconds(obj: dict[str, Any], key: str, where: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: `{key}` is {value!r}, not a number >= 0")
    return cast(float, value)


def _seconds(obj: dict[str, Any], key: str, where: str) -> float:
    value = _opt_seconds(obj, key, where)
    if value is None:
        raise ValueError(f"{where}: no `{key}`")
    return value


def _text(obj: dict[str, Any], key: str, where: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where}: `{key}` is {value!r}, not a string")
    return value
