"""Agent sessions as the router sees them: per tenant, the token ids already sent and their
block hashes, so a new turn tokenises and hashes only what it appended.

A session key is (tenant, session id): another tenant's session id opens a new session,
never someone else's. Each turn re-sends the whole prompt; when the new prompt starts with
the previous one's tokens, the chain is extended by the appended tokens alone; when it does
not (the client rewrote history), the chain is rebuilt from scratch. Either way the hashes
are exactly vLLM's for these token ids and this tenant's salt.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from appliance.domain.block_hash import BlockHashChain, BlockHasher, RequestKeys
from appliance.domain.records import SessionId, TaskId, TenantId, WorkerId


@dataclass(eq=False)
class SessionState:
    tenant: TenantId
    session_id: SessionId
    created_at: float
    task_id: TaskId | None = None
    token_ids: list[int] = field(default_factory=list)
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


class SessionTable:
    """Sessions by (tenant, id), least recently used first; bounded so memory stays flat."""

    def __init__(self, hasher: BlockHasher, *, max_sessions: int = 100_000) -> None:
        self._hasher = hasher
        self._max = max_sessions
        self._sessions: OrderedDict[tuple[str, str], SessionState] = OrderedDict()

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

    def hash_prompt(self, state: SessionState, token_ids: list[int], salt: str) -> BlockHashChain:
        """The prompt's block hashes, reusing the session's chain when the prompt extends it."""
        keys = RequestKeys(cache_salt=salt)
        chain = state.chain
        old = state.token_ids
        if (
            chain is not None
            and chain.keys == keys
            and len(token_ids) >= len(old)
            and token_ids[: len(old)] == old
        ):
            chain = self._hasher.extend(chain, token_ids[len(old) :])
        else:
            chain = self._hasher.chain(token_ids, keys=keys)
        state.chain = chain
        state.token_ids = list(token_ids)
        return chain

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
