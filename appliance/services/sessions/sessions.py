"""Agent sessions as the router sees them: per tenant, the token ids already sent and their
block hashes, so a new turn tokenises and hashes only what it appended.

A session key is (tenant, session id): another tenant's session id opens a new session,
never someone else's. Each turn re-sends the whole prompt; the chain keeps the hashes of the
full blocks the new prompt shares with the previous one and hashes only the blocks after
them (a chat template's last tokens often change when a reply is appended, so the shared
part is usually all but the last block; a client that rewrote history shares less). A
session's first turn starts from the latest chain of the same salt whose first block is the
same (sessions sharing a system prompt or context). Either way the hashes are exactly
vLLM's for these token ids and this tenant's salt.

The table is the one owner of a session's state: the turn desk, placement and the tokeniser
ask it to change one (`take_turn`, `placed`, `served`, `keep_chat`, ...); the others read it,
or hear of a turn's beginning and end as frozen events (`TurnBegan`, `TurnEnded`) sent to the
subscribers named when the table is built (the idle reaper).

A chat turn's ids come from services/sessions/chat_tokens.py, which tokenises only what it appended.
A session ends with its task (`forget_task`; not with a one-turn task's `done`: a session
the client named binds a one-turn task per turn); the table is bounded besides. A session the
prefix chain found (services/sessions/session_finder.py) is indexed by its last prompt's tip
(`tip`, `by_tip`) while it is in the table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from appliance.domain.block_hash import BlockHashChain, BlockHasher, RequestKeys
from appliance.domain.records import RecentSession, SessionId, TaskId, TenantId, WorkerId
from appliance.services.sessions.answer_tools import AnswerEnd
from appliance.services.sessions.chat_tokens import ChatTokens, TokenIds, token_ids


@dataclass(eq=False)
class SessionState:
    tenant: TenantId
    session_id: SessionId
    created_at: float
    task_id: TaskId | None = None
    token_ids: TokenIds = field(default_factory=lambda: token_ids(()))
    """The last prompt's ids."""
    chain: BlockHashChain | None = None
    home: WorkerId | None = None
    """The worker that served the previous turn."""
    turns: int = 0
    in_flight: int = 0
    last_active_at: float = 0.0
    tool_class: str | None = None
    """Its turn's `X-Tool-Class` (a hint; `said` is what its answer ended in)."""
    expected_wait_s: float | None = None
    said: AnswerEnd | None = None
    """How its last turn's answer ended (tool calls, or back to the person); None while a
    turn runs, or when the answer did not say (`answer_tools.py`)."""
    resident_tokens: dict[WorkerId, int] = field(default_factory=dict)
    chat: ChatTokens | None = None
    """The last turn's rendered chat and ids, for `encode_chat_text` on the next turn."""
    messages: list[Any] | None = None
    """The last chat turn's messages (with `chat`: the next turn may be forwarded before it
    is tokenised when it only appends to them; see `appended_token_bound`)."""
    stem_tokens: int = 0
    """Leading tokens of its prompts that render its system messages and tool schemas
    (`ChatTokens.stem`): what its end leaves cached for its agent's next session."""
    task_done: bool = False
    """Its task closed while a turn of it ran: it goes when that turn ends."""
    overflowed_at: float | None = None
    """When a turn of it was last refused for a prompt that leaves the window no room: its
    harness compacts, so the KV of its last prompt past the stem is not used again."""
    prompt_tip: bytes | None = None
    """Its last prompt's messages' chain hash, when its session was found by the prefix
    chain (services/sessions/session_finder.py); a turn that extends them may be its next."""
    claimed: object | None = None
    """The finding of a turn that took it by its tip, until that turn's run is over (it has
    begun, or failed first): no other turn takes it meanwhile."""


@dataclass(frozen=True, slots=True)
class TurnBegan:
    """A turn of `session` starts `at`. The session is the table's: to read, never to change."""

    session: SessionState
    at: float


@dataclass(frozen=True, slots=True)
class TurnEnded:
    """`session` has no turn in flight any more since `at`: its last answer (or stream) has
    ended, however it ended (`session.said`: how, when the answer said)."""

    session: SessionState
    at: float


class TurnSubscriber(Protocol):
    """Hears of each session's turn starting, and of a session left with no turn in flight."""

    def turn_began(self, event: TurnBegan) -> None: ...

    def turn_ended(self, event: TurnEnded) -> None: ...


@dataclass(frozen=True, slots=True)
class TurnHints:
    """What a turn says of its session (`SessionTable.take_turn`)."""

    tool_class: str | None = None
    expected_wait_s: float | None = None
    chat: ChatTokens | None = None
    messages: list[Any] | None = None
    incremental: bool = False
    """Its chat is tokenised incrementally (or is about to be): `chat` and `messages` are
    kept for the next turn."""
    prompt_tip: bytes | None = None


def one_turn(session: SessionState) -> bool:
    """A turn that named neither a session nor a task: nothing comes back to it."""
    task = session.task_id or ""
    return session.session_id.startswith("task:") and task.split("/", 1)[-1].startswith("turn-")


class SessionTable:
    """Sessions by (tenant, id), least recently used first; bounded so memory stays flat.
    `subscribers` (the idle reaper) hear of every turn's start and end, in their order."""

    def __init__(
        self,
        hasher: BlockHasher,
        *,
        max_sessions: int = 100_000,
        max_donors: int = 256,
        subscribers: Sequence[TurnSubscriber] = (),
    ) -> None:
        self._hasher = hasher
        self._subscribers = tuple(subscribers)
        self._max = max_sessions
        self._sessions: OrderedDict[tuple[str, str], SessionState] = OrderedDict()
        self._donors: OrderedDict[tuple[str, tuple[int, ...]], tuple[TokenIds, BlockHashChain]]
        self._donors = OrderedDict()
        """The latest prompt (ids, chain) by salt and first block: a new session's first turn
        starts from the hashes of what it shares with it (a common system prompt)."""
        self._max_donors = max_donors
        self._by_task: dict[TaskId, set[tuple[str, str]]] = {}
        """Sessions by their task, so a task's end ends them (`forget_task`)."""
        self._tips: dict[tuple[str, bytes], dict[SessionState, None]] = {}
        """Sessions of the prefix chain by (tenant, their tip), oldest first: one entry for
        each such session in the table, gone with it."""

    def get(self, tenant: TenantId, session_id: SessionId) -> SessionState | None:
        return self._sessions.get((tenant, session_id))

    def open(self, tenant: TenantId, session_id: SessionId, now: float) -> SessionState:
        key = (tenant, session_id)
        state = self._sessions.get(key)
        if state is None:
            state = SessionState(tenant, session_id, created_at=now, last_active_at=now)
            self._sessions[key] = state
            self._evict_idle()
        self._sessions.move_to_end(key)
        return state

    def bind_task(self, state: SessionState, task: TaskId | None) -> None:
        """The session's turns belong to `task` from now on."""
        if state.task_id == task:
            return
        key = (state.tenant, state.session_id)
        self._unbind(key, state)
        state.task_id, state.task_done = task, False
        if task is not None:
            self._by_task.setdefault(task, set()).add(key)

    def forget_task(self, task: TaskId) -> None:
        """The task closed: its sessions end (now, or when their turn in flight ends). What
        their KV is worth is the idle reaper's, which holds its own."""
        for key in self._by_task.pop(task, ()):
            state = self._sessions.get(key)
            if state is None or state.task_id != task:
                continue
            if state.in_flight:
                state.task_done = True
            else:
                self._drop(key)

    def _unbind(self, key: tuple[str, str], state: SessionState) -> None:
        if state.task_id is not None and (keys := self._by_task.get(state.task_id)):
            keys.discard(key)
            if not keys:
                del self._by_task[state.task_id]

    def tip(self, state: SessionState, tip: bytes) -> None:
        """The session's last prompt's messages chain to `tip` (`session_finder.prompt_chain`)."""
        if state.prompt_tip != tip:
            self._untip(state)
            state.prompt_tip = tip
            self._tips.setdefault((state.tenant, tip), {})[state] = None

    def by_tip(self, tenant: TenantId, tips: Sequence[bytes]) -> tuple[int, Iterator[SessionState]]:
        """The sessions whose tip is the longest of `tips` any session has (the latest
        first), and how many of `tips` that is (0, and none, when no session has any)."""
        for n in range(len(tips), 0, -1):
            holders = self._tips.get((tenant, tips[n - 1]))
            if holders:
                return n, reversed(holders)
        return 0, iter(())

    def claim(self, state: SessionState, by: object) -> None:
        """A turn (`by`, its finding) took the session by its tip: no other turn takes it
        until `unclaim`."""
        state.claimed = by

    def unclaim(self, state: SessionState, by: object) -> None:
        """The turn that claimed the session (`by`) has begun, or failed first."""
        if state.claimed is by:
            state.claimed = None

    def _untip(self, state: SessionState) -> None:
        if state.prompt_tip is not None:
            key = (state.tenant, state.prompt_tip)
            holders = self._tips.get(key, {})
            holders.pop(state, None)
            if not holders:
                self._tips.pop(key, None)
            state.prompt_tip = None

    def take_turn(
        self,
        tenant: TenantId,
        session_id: SessionId,
        task: TaskId | None,
        now: float,
        hints: TurnHints,
    ) -> SessionState:
        """The session a turn of `task` is of (opened if new), with what the turn says of
        it: its agent's hints, its chat when tokenised incrementally (or about to be:
        anything else makes the next turn tokenise before it is placed), its tip."""
        state = self.open(tenant, session_id, now)
        self.bind_task(state, task)
        state.tool_class = hints.tool_class
        state.expected_wait_s = hints.expected_wait_s
        self.keep_chat(state, hints.chat if hints.incremental else None)
        state.messages = hints.messages if hints.incremental else None
        if hints.prompt_tip is not None:
            self.tip(state, hints.prompt_tip)
        return state

    def keep_chat(self, state: SessionState, chat: ChatTokens | None) -> None:
        """The session's last turn was rendered as `chat` (None: not incrementally)."""
        state.chat = chat
        if chat is not None and chat.stem:
            state.stem_tokens = chat.stem

    def untokenised(self, state: SessionState) -> None:
        """Its last turn could not be tokenised: the next one is tokenised before it is placed."""
        state.chat = state.messages = None

    def placed(
        self,
        state: SessionState,
        prompt: tuple[TokenIds, BlockHashChain, str] | None,
        resident: dict[WorkerId, int],
    ) -> None:
        """A turn of the session goes where `resident` was predicted; `prompt`: its ids,
        chain and salt, when it was tokenised (None: placed on the last prompt's chain)."""
        if prompt is not None:
            self.adopt(state, *prompt)
        state.resident_tokens = dict(resident)

    def served(self, state: SessionState, worker: WorkerId, said: AnswerEnd | None) -> None:
        """`worker` answered the session's turn (`said`: how its answer ended, when known)."""
        state.home = worker
        state.said = said

    def began(self, state: SessionState, now: float) -> None:
        """A turn of the session starts now."""
        state.in_flight += 1
        state.turns += 1
        state.last_active_at = now
        state.said = None  # the last answer's end is history
        event = TurnBegan(state, now)
        for subscriber in self._subscribers:
            subscriber.turn_began(event)

    def heard(self, state: SessionState, said: AnswerEnd | None) -> None:
        """How the answer of the session's stream ended, once it has (None: it did not say)."""
        state.said = said

    def ended(self, state: SessionState, now: float) -> None:
        """A turn of the session has ended (its answer, or its stream), however it ended.
        A turn that named neither a session nor a task leaves no session: nothing comes
        back to it (kept, every plain request would hold its prompt until the cap)."""
        state.in_flight -= 1
        state.last_active_at = now
        if not state.in_flight:
            event = TurnEnded(state, now)
            for subscriber in self._subscribers:
                subscriber.turn_ended(event)
        if not state.in_flight and (one_turn(state) or state.task_done):
            self._drop((state.tenant, state.session_id))

    def restore(self, sessions: Iterable[RecentSession]) -> None:
        """Takes back recent sessions from the ledger after a restart, least recently active
        first: their home worker and task; their prefix chain comes with their next turn."""
        for r in sessions:
            state = self.open(TenantId(r.tenant), SessionId(r.session_id), r.created_at)
            state.home = WorkerId(r.worker) if r.worker else None
            self.bind_task(state, TaskId(r.task_id) if r.task_id else None)
            state.last_active_at = r.last_active_at or r.created_at

    def hash_prompt(
        self, state: SessionState, prompt_ids: Sequence[int], salt: str
    ) -> BlockHashChain:
        """`chain_for` the prompt, then `adopt` it: the session's last prompt is this one."""
        ids = token_ids(prompt_ids)
        chain = self.chain_for(state, ids, salt)
        self.adopt(state, ids, chain, salt)
        return chain

    def chain_for(self, state: SessionState, ids: TokenIds, salt: str) -> BlockHashChain:
        """The prompt's block hashes, reusing the session's chain (or, on its first turn, the
        latest chain of the same salt that starts with the same block) for what it shares.
        Changes nothing: `adopt` makes it the session's."""
        keys = RequestKeys(cache_salt=salt)
        bs = self._hasher.block_size
        chain, old = state.chain, state.token_ids
        if (chain is None or chain.keys != keys) and len(ids) >= bs:
            old, chain = self._donors.get((salt, tuple(ids[:bs]))) or (old, None)
        if chain is None or chain.keys != keys:
            return self._hasher.chain(ids, keys=keys)
        if len(ids) >= len(old) and ids[: len(old)] == old:
            return self._hasher.extend(chain, ids[len(old) :])
        keep = _shared_blocks(old, ids, bs, len(chain.hashes))
        return self._hasher.extend(chain.prefix(keep), ids[keep * bs :])

    def adopt(self, state: SessionState, ids: TokenIds, chain: BlockHashChain, salt: str) -> None:
        """The session's last prompt is `ids` (hashed as `chain`), and a donor for the next
        new session whose first block is the same."""
        state.chain = chain
        state.token_ids = ids
        bs = self._hasher.block_size
        if len(ids) < bs:
            return
        donor = (salt, tuple(ids[:bs]))
        self._donors[donor] = (ids, chain)
        self._donors.move_to_end(donor)
        if len(self._donors) > self._max_donors:
            self._donors.popitem(last=False)

    def _evict_idle(self) -> None:
        while len(self._sessions) > self._max:
            key, state = next(iter(self._sessions.items()))
            if state.in_flight:
                self._sessions.move_to_end(key)  # never drop a session mid-request
                if all(s.in_flight for s in self._sessions.values()):
                    return
                continue
            self._drop(key)

    def _drop(self, key: tuple[str, str]) -> None:
        state = self._sessions.pop(key, None)
        if state is not None:
            self._unbind(key, state)
            self._untip(state)
            # The idle reaper may watch its KV a while longer; it needs no conversation.
            state.messages, state.chat = None, None

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._sessions.values()))

    def __len__(self) -> int:
        return len(self._sessions)


def _shared_blocks(old: TokenIds, new: TokenIds, block_size: int, limit: int) -> int:
    """How many leading full blocks (at most `limit`) `old` and `new` have in common."""
    hi = min(limit, len(new) // block_size, len(old) // block_size)
    if old[: hi * block_size] == new[: hi * block_size]:
        return hi
    lo = 0  # blocks [0, lo) are shared, block hi is not
    hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if old[: mid * block_size] == new[: mid * block_size]:
            lo = mid
        else:
            hi = mid - 1
    return lo
