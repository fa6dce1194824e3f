"""The values of one model turn's life: the request (`TurnRequest`, from the API's hand-over
to its records), the port the desk tokenises it through (`TurnTokenizer`), each attempt at a
worker, and the reply the API sends back."""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

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


NO_TASK = TaskId("")
"""A turn's task key before the desk has opened its task."""


class TurnTokenizer(Protocol):
    """The port through which the desk tokenises a turn (the API's adapter fills it: it
    knows each API's prompt and words)."""

    def tokenize(
        self, turn: TurnRequest, previous: ChatTokens | None
    ) -> tuple[Sequence[int], ChatTokens | None]:
        """The turn's prompt ids and its rendered chat (None: not incremental), past
        `previous`, the session's last chat; raises when the request cannot be served."""
        ...

    def estimate(self, turn: TurnRequest, session: SessionState | None) -> int | None:
        """The prompt's likely length when the turn may go before it is tokenised (it only
        appends text to `session`'s last turn), else None."""
        ...


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """A model turn, from the API's hand-over (authenticated, its body and headers checked)
    to its records. The desk fills in what it learns: its task's key, its prompt's ids
    (`TurnTokenizer`), the priority admission grants it, its side."""

    tenant: TenantId
    path: str
    """/v1/chat/completions, /v1/completions or /v1/responses."""
    body: dict[str, Any]
    prompt_ids: Sequence[int] | None = None
    """None until tokenised; a turn forwarded before it is tokenised stays None."""
    task_id: TaskId = NO_TASK
    """Its task's key (tenant/id), once the desk has it."""
    session_id: SessionId | None = None
    parent_task_id: TaskId | None = None
    """Its task's parent's key, once the task is open."""
    client_task_id: str | None = None
    """X-Task-ID; None: a one-turn task of its own."""
    client_parent_id: str | None = None
    """X-Parent-Task-ID."""
    deadline_s: float | None = None
    asked_priority: int | None = None
    """X-Priority as sent (`priority`: what admission grants)."""
    tool_class: str | None = None
    expected_wait_s: float | None = None
    client_salt: str | None = None
    max_tokens: int | None = None
    """The answer's `max_tokens` (None: not given)."""
    messages_api: bool = False
    """A Messages API turn made a chat turn: its answer must fit the model's window too,
    and a prompt too long is refused in its words."""
    tools: list[dict[str, Any]] | None = None
    """A Responses turn's function tools, in chat's shape (its prompt renders them)."""
    messages: list[Any] | None = None
    """A plain chat's messages, kept with `chat` so the next turn can go untokenised."""
    conversation: Sequence[Any] | None = None
    """A chat's messages, to find its session by their prefix when it names none
    (services/sessions/session_finder.py); a Responses turn's, rendered as its prompt."""
    escalate: str | None = None
    """X-Escalate: an outside endpoint's name, or `local` (services/escalation/)."""
    chat: ChatTokens | None = None
    """The rendered chat behind `prompt_ids`, kept so the session's next turn tokenises only
    what it appends."""
    previous_chat: ChatTokens | None = None
    """The session's last chat when the turn arrived: what a turn forwarded untokenised is
    tokenised after (services/turns/sent_tokens.py)."""
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
