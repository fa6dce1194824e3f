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

Tokenising: `encode_chat_text` turns a rendered chat into token ids reusing the previous
turn's `ChatTokens`, for tokenizers that declare `split_before` (strings before which their
`encode` cuts the text and tokenises each piece on its own). The text up to the last such
cut that the new text shares is not tokenised again, and the ids are the ones a whole
`encode` gives; `ChatEncoder` also remembers long pieces across sessions. A tokenizer
without the declaration is always tokenised whole.
"""

from __future__ import annotations

import re
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from appliance.domain.block_hash import BlockHashChain, BlockHasher, RequestKeys
from appliance.domain.records import RecentSession, SessionId, TaskId, TenantId, WorkerId

TokenIds = array
"""Token ids as machine integers (`array('q')`): one object to Python's cyclic collector,
where a tuple or list of ints has every item visited each time a collection meets it (tens
of microseconds per 8k-token prompt); also a quarter of the memory, compared by memcmp."""


def token_ids(ids: Sequence[int]) -> TokenIds:
    """`ids` as TokenIds, without a copy when they already are."""
    return ids if isinstance(ids, array) else array("q", ids)


@dataclass(frozen=True, slots=True)
class ChatTokens:
    """A rendered chat and its token ids, with `cuts`: (text offset, token offset) of each
    place where the tokenizer's `split_before` strings cut the text, in order."""

    text: str
    ids: TokenIds
    cuts: tuple[tuple[int, int], ...]


def encode_chat_text(
    text: str,
    encode: Callable[[str], Sequence[int]],
    split_before: Sequence[str],
    previous: ChatTokens | None = None,
) -> ChatTokens:
    """`encode(text)`, for a tokenizer with `encode(a + b) == encode(a) + encode(b)` whenever
    `b` starts with one of `split_before`: tokenises only what follows the last cut of
    `previous` that `text` shares, piece by piece, recording the cuts for the next turn."""
    splitter = _splitter(tuple(split_before))
    ids = token_ids(())
    cuts: list[tuple[int, int]] = []
    start = 0
    if previous is not None:
        shared = _shared_cut(previous, text, splitter)
        if shared is not None:
            start, n_ids = previous.cuts[shared]
            ids = previous.ids[:n_ids]
            cuts = list(previous.cuts[:shared])
    bounds = [start, *(m.start() for m in splitter.finditer(text, start) if m.start() > start)]
    for a, b in zip(bounds, [*bounds[1:], len(text)], strict=True):
        cuts.append((a, len(ids)))
        if b > a:
            ids.extend(encode(text[a:b]))
    return ChatTokens(text, ids, tuple(cuts))


class ChatEncoder:
    """`encode_chat_text` for one tokenizer, remembering the ids of long pieces (a system
    prompt or context that many sessions share) so that a new session's first turn does
    not tokenise them again. Bounded: the least recently used piece goes first."""

    def __init__(
        self,
        encode: Callable[[str], list[int]],
        split_before: Sequence[str],
        *,
        min_chars: int = 2048,
        max_pieces: int = 256,
    ) -> None:
        self._encode = encode
        self.split_before = tuple(split_before)
        self._min_chars = min_chars
        self._max_pieces = max_pieces
        self._pieces: OrderedDict[str, TokenIds] = OrderedDict()

    def __call__(self, text: str, previous: ChatTokens | None = None) -> ChatTokens:
        return encode_chat_text(text, self._piece, self.split_before, previous)

    def _piece(self, text: str) -> Sequence[int]:
        if len(text) < self._min_chars:
            return self._encode(text)
        ids = self._pieces.get(text)
        if ids is not None:
            self._pieces.move_to_end(text)
            return ids
        ids = self._pieces[text] = token_ids(self._encode(text))
        if len(self._pieces) > self._max_pieces:
            self._pieces.popitem(last=False)
        return ids


def _shared_cut(previous: ChatTokens, text: str, splitter: re.Pattern[str]) -> int | None:
    """Index of the last cut of `previous` whose text before it `text` repeats and after
    which `text` also starts with a split string; None when there is none."""
    cuts = previous.cuts
    lo, hi = 0, len(cuts) - 1
    if hi < 0 or not text.startswith(previous.text[: cuts[0][0]]):
        return None
    while lo < hi:  # the shared prefix only shrinks as the cut moves right
        mid = (lo + hi + 1) // 2
        if text.startswith(previous.text[: cuts[mid][0]]):
            lo = mid
        else:
            hi = mid - 1
    for i in range(lo, -1, -1):
        offset = cuts[i][0]
        if offset == 0 or splitter.match(text, offset):
            return i
    return None


_SPLITTERS: dict[tuple[str, ...], re.Pattern[str]] = {}


def _splitter(strings: tuple[str, ...]) -> re.Pattern[str]:
    pattern = _SPLITTERS.get(strings)
    if pattern is None:
        pattern = _SPLITTERS[strings] = re.compile("|".join(map(re.escape, strings)))
    return pattern


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
    expected_wait_s: float | None = None
    resident_tokens: dict[WorkerId, int] = field(default_factory=dict)
    last_reason: str | None = None
    chat: ChatTokens | None = None
    """The last turn's rendered chat and ids, for `encode_chat_text` on the next turn."""
    messages: list[Any] | None = None
    """The last chat turn's messages (with `chat`: the next turn may be forwarded before it
    is tokenised when it only appends to them; see `appended_token_bound`)."""


class TurnListener(Protocol):
    """Told when a session's turn starts, and when it has no turn left in flight."""

    def turn_began(self, session: SessionState, now: float) -> None: ...

    def turn_ended(self, session: SessionState, now: float) -> None: ...


def one_turn(session: SessionState) -> bool:
    """A turn that named neither a session nor a task: nothing comes back to it."""
    task = session.task_id or ""
    return session.session_id.startswith("task:") and task.split("/", 1)[-1].startswith("turn-")


class SessionTable:
    """Sessions by (tenant, id), least recently used first; bounded so memory stays flat.
    `listener` (the idle reaper) hears of every turn's start and end."""

    def __init__(
        self,
        hasher: BlockHasher,
        *,
        max_sessions: int = 100_000,
        max_donors: int = 256,
        listener: TurnListener | None = None,
    ) -> None:
        self._hasher = hasher
        self.listener = listener
        self._max = max_sessions
        self._sessions: OrderedDict[tuple[str, str], SessionState] = OrderedDict()
        self._donors: OrderedDict[tuple[str, tuple[int, ...]], tuple[TokenIds, BlockHashChain]]
        self._donors = OrderedDict()
        """The latest prompt (ids, chain) by salt and first block: a new session's first turn
        starts from the hashes of what it shares with it (a common system prompt)."""
        self._max_donors = max_donors

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

    def began(self, state: SessionState, now: float) -> None:
        """A turn of the session starts now."""
        state.in_flight += 1
        state.turns += 1
        state.last_active_at = now
        if self.listener is not None:
            self.listener.turn_began(state, now)

    def ended(self, state: SessionState, now: float) -> None:
        """A turn of the session has ended (its answer, or its stream), however it ended.
        A turn that named neither a session nor a task leaves no session: nothing comes
        back to it (kept, every plain request would hold its prompt until the cap)."""
        state.in_flight -= 1
        state.last_active_at = now
        if not state.in_flight and self.listener is not None:
            self.listener.turn_ended(state, now)
        if not state.in_flight and one_turn(state):
            self._sessions.pop((state.tenant, state.session_id), None)

    def restore(self, sessions: Iterable[RecentSession]) -> None:
        """Takes back recent sessions from the ledger after a restart, least recently active
        first: their home worker and task; their prefix chain comes with their next turn."""
        for r in sessions:
            state = self.open(TenantId(r.tenant), SessionId(r.session_id), r.created_at)
            state.home = WorkerId(r.worker) if r.worker else None
            state.task_id = TaskId(r.task_id) if r.task_id else None
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
            del self._sessions[key]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._sessions.values()))

    def __len__(self) -> int:
        return len(self._sessions)


TEMPLATE_MARGIN_TOKENS = 64
"""Tokens a chat template may add around one message (role markers, separators, special
tokens) or at the end (the generation prompt): a generous bound, not a measurement."""


@dataclass(frozen=True, slots=True)
class Appended:
    """What a chat turn adds to its session's last turn: `messages` messages of plain text,
    `text_bytes` bytes of it (UTF-8)."""

    messages: int
    text_bytes: int

    def token_bound(self, previous_tokens: int) -> int:
        """At most this many tokens in the new turn, after a last turn of `previous_tokens`.

        Why it bounds: a token covers at least one byte of text (byte-level BPE,
        SentencePiece with byte fallback, the simulator's words), so the appended text adds
        at most its UTF-8 length, and the template at most a margin per message and one for
        the generation prompt."""
        return previous_tokens + self.text_bytes + TEMPLATE_MARGIN_TOKENS * (self.messages + 1)

    def token_estimate(self, previous: ChatTokens) -> int:
        """The likely token count: the appended text at the last turn's tokens per byte."""
        per_byte = len(previous.ids) / max(1, len(previous.text))  # ASCII-heavy: chars ~ bytes
        return len(previous.ids) + round(self.text_bytes * per_byte) + 4 * self.messages


def resumable(session: SessionState | None, messages: Sequence[Any]) -> Appended | None:
    """What a chat turn appends to its session's last turn, when the turn may be placed and
    forwarded before it is tokenised: the session has no turn in flight, its last turn was
    tokenised incrementally (so it has `chat`, `messages` and a chain) and this turn only
    appends plain text to it. None: tokenise first."""
    if session is None or session.in_flight or session.chain is None:
        return None
    if session.chat is None or session.messages is None:
        return None
    return appended(session.messages, messages)


def appended(previous: Sequence[Any], messages: Sequence[Any]) -> Appended | None:
    """What `messages` append to `previous`, when they repeat it and append only messages
    of plain text fields; None otherwise (a rewritten history, parts, tool calls), and the
    turn must be tokenised before anything is decided."""
    n = len(previous)
    if len(messages) <= n or messages[:n] != previous:
        return None
    text_bytes = 0
    for message in messages[n:]:
        if not isinstance(message, dict):
            return None
        for value in message.values():
            if value is None:
                continue
            if not isinstance(value, str):
                return None  # parts, tool calls: rendered in ways a byte count cannot bound
            text_bytes += len(value.encode())
    return Appended(len(messages) - n, text_bytes)


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
