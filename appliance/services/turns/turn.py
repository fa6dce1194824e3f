"""The values of one model turn's life: the request as the API hands it over (`TurnInput`),
as the desk places it (`TurnRequest`), each attempt at a worker, and the reply the API sends
back."""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from appliance.domain.errors import ApplianceError
from appliance.domain.records import SessionId, TaskId, TenantId, TurnId, WorkerId
from appliance.services.sessions.answer_tools import AnswerEnd
from appliance.services.sessions.chat_tokens import ChatTokens
from appliance.services.sessions.sessions import SessionState

_PROCESS = secrets.randbits(64)
_SERIAL = itertools.count()


def new_turn_id() -> TurnId:
    """A new attempt's id: 32 hex digits like a UUID's, this process's random 64 bits then a
    serial number, so unique across restarts without a random draw per turn (os.urandom is
    a system call that lets the ledger's and the KV events' threads take the interpreter
    in the middle of the turn)."""
    return TurnId(f"{_PROCESS:016x}{next(_SERIAL):016x}")


class NoWorker(ApplianceError):
    code = "no_healthy_worker"
    http_status = 503


Tokenize = Callable[[ChatTokens | None], tuple[Sequence[int], ChatTokens | None]]
"""The session's last chat (or None) -> the turn's ids and its rendered chat."""


@dataclass(frozen=True, slots=True)
class TurnInput:
    """A model turn as the API hands it over: authenticated, its body and headers checked."""

    tenant: TenantId
    path: str
    body: dict[str, Any]
    tokenize: Tokenize
    estimate: Callable[[SessionState | None], int | None]
    """The likely prompt length when the turn may go before it is tokenised, else None."""
    messages: list[Any] | None = None  # a plain chat's (the next turn's base)
    task_id: str | None = None  # X-Task-ID; None: a one-turn task of its own
    session_id: SessionId | None = None
    parent_task_id: str | None = None
    deadline_s: float | None = None
    priority: int | None = None
    tool_class: str | None = None
    expected_wait_s: float | None = None
    client_salt: str | None = None
    received_at: float | None = None  # when the whole request had arrived (monotonic)
    pinned: WorkerId | None = None  # see TurnRequest
    route_note: str | None = None
    conversation: Sequence[Any] | None = None
    """A chat's messages, to find its session by their prefix when it names none
    (services/sessions/session_finder.py)."""
    prompt_tip: bytes | None = None  # see TurnRequest
    escalate: str | None = None
    """X-Escalate: an outside endpoint's name, or `local` (services/escalation/)."""


@dataclass(frozen=True, slots=True)
class TurnRequest:
    tenant: TenantId
    path: str
    """/v1/chat/completions or /v1/completions."""
    body: dict[str, Any]
    prompt_ids: Sequence[int] | None
    """None when the turn is forwarded before it is tokenised (`tokenize` is then set)."""
    task_id: TaskId
    session_id: SessionId | None = None
    parent_task_id: TaskId | None = None
    client_salt: str | None = None
    tool_class: str | None = None
    expected_wait_s: float | None = None
    chat: ChatTokens | None = None
    """The rendered chat behind `prompt_ids`, kept so the session's next turn tokenises only
    what it appends."""
    messages: list[Any] | None = None
    """A chat's messages, kept with `chat` so the next turn can be forwarded untokenised."""
    tokenize: Callable[[], tuple[Sequence[int], ChatTokens | None]] | None = None
    """For a turn forwarded untokenised: its ids and chat, computed after it was sent."""
    estimated_tokens: int = 0
    """The prompt's likely length while `prompt_ids` is None."""
    received_at: float | None = None
    """When the whole request had arrived (time.monotonic()), if the server says."""
    priority: int = 0
    """X-Priority clipped to the tenant's ceiling by admission (higher runs first)."""
    pinned: WorkerId | None = None
    """The only worker that may serve it (a chained Responses turn: the one storing it)."""
    route_note: str | None = None
    """Said first in its route decision's reason (where its session and pin came from)."""
    prompt_tip: bytes | None = None
    """Its messages' chain hash, when the prefix chain found its session: the session's
    tip from now on (services/sessions/session_finder.py)."""
    side_reason: str | None = None
    """Why it is on the local box when escalation rules are set (its row's route_reason)."""

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids) if self.prompt_ids is not None else self.estimated_tokens


@dataclass(eq=False)
class Attempt:
    turn_id: TurnId
    worker: WorkerId
    predicted_cached: int
    started_at: float
    estimated_prefill_s: float
    first_byte_at: float | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    prefix_digest: str | None = None
    """Hex digest of the prompt's last full block: names the cached prefix in a receipt."""
    prefix_tokens: int = 0
    chunks: int = 0
    """Chunks of its stream relayed so far (about one token each)."""
    queue_s: float = 0.0
    """From the whole request's arrival to this attempt's leaving for its worker."""
    gpu_s: float = 0.0
    """Its share of its worker's busy GPU-seconds, once it has ended (GpuMeter)."""
    generation: int = 0
    """The worker's cache generation at placement: its receipt's (a reset during the attempt
    makes the receipt stale, rather than one that may claim a prefix the reset dropped)."""
    recorded: Future[float | None] | None = None
    """Its turn row's write, once it has ended (Forwarder.finish: exactly once)."""
    said: AnswerEnd | None = None
    """How its answer ended (tool calls, or back to the person), once whole; None: it did
    not say (`answer_tools.py`)."""


@dataclass(frozen=True, slots=True)
class Reply:
    """A finished non-streaming answer, or the head of a stream (`chunks` then yields it)."""

    status: int
    headers: dict[str, str]
    body: bytes = b""
    """A finished answer's JSON, relayed as the worker wrote it."""
    chunks: AsyncGenerator[bytes, None] | None = None
    on_end: Callable[[], None] | None = None
    """A stream's: runs once it has ended, however it ended."""
    session_id: SessionId | None = None
    """The session the turn was of (named, or found), when it had one."""


def turn_request(
    t: TurnInput,
    task_id: TaskId,
    ids: Sequence[int] | None,
    chat: ChatTokens | None,
    tokenize: Callable[[], tuple[Sequence[int], ChatTokens | None]] | None,
    n_prompt: int,
) -> TurnRequest:
    """The turn as the desk places it, of the task `task_id` (its parent and the priority
    admission gives it are set once the task is opened)."""
    return TurnRequest(
        tenant=t.tenant,
        path=t.path,
        body=t.body,
        prompt_ids=ids,
        task_id=task_id,
        session_id=t.session_id,
        client_salt=t.client_salt,
        tool_class=t.tool_class,
        expected_wait_s=t.expected_wait_s,
        chat=chat,
        messages=t.messages,
        tokenize=tokenize,
        estimated_tokens=n_prompt,
        received_at=t.received_at,
        pinned=t.pinned,
        route_note=t.route_note,
        prompt_tip=t.prompt_tip,
    )


def cached_tokens(usage: dict[str, Any]) -> int | None:
    """The worker's `usage.prompt_tokens_details.cached_tokens`, when it says."""
    details = usage.get("prompt_tokens_details") or {}
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return int(value) if value is not None else None


def reasoning_tokens(usage: dict[str, Any]) -> int:
    """The worker's `usage.completion_tokens_details.reasoning_tokens`, 0 when it says none."""
    details = usage.get("completion_tokens_details") or {}
    value = details.get("reasoning_tokens") if isinstance(details, dict) else None
    return max(0, int(value or 0))


class Soon:
    """A call made on the event loop's next turn (after the current task's sends went out),
    or by `now()` when its result is needed first; once either way."""

    def __init__(self, call: Callable[[], None]) -> None:
        self._call: Callable[[], None] | None = call
        self._handle = asyncio.get_running_loop().call_soon(self.now)

    def now(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            self._handle.cancel()
            call()
