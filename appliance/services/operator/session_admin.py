"""An operator's hand on one session: find it, and release the KV the appliance holds for it.

Model of the world: a session is (tenant, session id); ids are chosen by each tenant, so the
operator names the tenant too, or leaves it out when only one tenant has a session of that
id. Releasing drops the holds on the session's KV so that the room can go to others: every
worker whose retention connector holds it is told to release it (`kv_release`, the idle
reaper's `release`), and the reaper holds it no more until its next turn; the blocks stay
in the engine's prefix cache, least recently used first, until the engine needs the room.
The session's residency decision reads "released" ("released by operator") until its next
turn starts, a `residency_events` row (session `tenant/id`, action "release", the tokens it
had on the GPU: the state's figure, so the operator's dialog, the answer and the row agree)
is written where the release is made, and the event feed says so. A session with a request
in flight is never released (its KV is in use); releasing a session that is released
already changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from appliance.domain.errors import ApplianceError
from appliance.domain.records import CacheTier, ResidencyEvent, SessionId, TenantId, WorkerId
from appliance.ports import Ledger
from appliance.services.operator.events import EventFeed, EventKind
from appliance.services.sessions.sessions import SessionState, SessionTable

RELEASED = "released"
RELEASE_REASON = "released by operator"


class SessionAdminError(ApplianceError):
    code = "session_error"
    http_status = 400


@dataclass(frozen=True, slots=True)
class Release:
    at: float
    turns: int
    """The session's turns when it was released: a later turn ends the release."""
    tokens: int
    """Tokens the session held on the GPU when it was released."""
    bytes: int


class SessionReleases:
    def __init__(
        self,
        sessions: SessionTable,
        ledger: Ledger,
        feed: EventFeed,
        kv_bytes_per_token: int,
        kv_release: Callable[[SessionState], list[WorkerId]] | None = None,
    ) -> None:
        """`kv_release`: lets the session's KV go in the workers; returns the workers told."""
        self._sessions = sessions
        self._kv_release = kv_release
        self._ledger = ledger
        self._feed = feed
        self.kv_bytes_per_token = kv_bytes_per_token
        self._released: dict[tuple[str, str], Release] = {}

    def find(self, session_id: str, tenant: str | None = None) -> SessionState:
        """The session of this id (of `tenant`, or of the one tenant that has such an id)."""
        if tenant is not None:
            found = self._sessions.get(TenantId(tenant), SessionId(session_id))
            if found is None:
                raise SessionAdminError(
                    f"session {session_id} of tenant {tenant} not found",
                    code="session_not_found",
                    http_status=404,
                )
            return found
        matches: list[SessionState] = [s for s in self._sessions if s.session_id == session_id]
        if not matches:
            raise SessionAdminError(
                f"session {session_id} not found", code="session_not_found", http_status=404
            )
        if len(matches) > 1:
            tenants = ", ".join(sorted(s.tenant for s in matches))
            raise SessionAdminError(
                f"session {session_id} exists for tenants {tenants}; pass ?tenant=NAME",
                code="session_ambiguous",
            )
        return matches[0]

    def in_effect(self, session: SessionState) -> Release | None:
        """The session's release, while no turn has started since."""
        key = (session.tenant, session.session_id)
        release = self._released.get(key)
        if release is None:
            return None
        if session.turns != release.turns or session.in_flight:
            del self._released[key]
            return None
        return release

    def release(
        self, session: SessionState, now: float, gpu_tokens: int | None = None
    ) -> tuple[Release, Future[None] | None]:
        """Releases the session; returns the release and its ledger write (None when it was
        released already). Raises SessionAdminError (409) while a request is in flight.
        `gpu_tokens`: its prefix on a GPU now, the figure the state shows of it (the KV
        index's, `SessionKv.now`), which the release, its row and its event say; None: what
        its last placement found there."""
        if session.in_flight:
            raise SessionAdminError(
                f"session {session.session_id} of tenant {session.tenant} has a request in "
                "flight; release it after the turn ends",
                code="session_in_flight",
                http_status=409,
            )
        held = self.in_effect(session)
        if held is not None:
            return held, None
        placed = max(session.resident_tokens.values(), default=0)
        tokens = gpu_tokens if gpu_tokens is not None else placed
        release = Release(now, session.turns, tokens, tokens * self.kv_bytes_per_token)
        told = self._kv_release(session) if self._kv_release is not None else []
        self._released[(session.tenant, session.session_id)] = release
        written = self._ledger.record_residency_event(
            ResidencyEvent(
                at=now,
                session_id=SessionId(f"{session.tenant}/{session.session_id}"),
                worker=session.home,
                action="release",
                reason=RELEASE_REASON,
                tokens=tokens,
                tier=CacheTier.GPU,
            )
        )
        where = f" on {session.home}" if session.home else ""
        if told:
            where += f"; holds released on {', '.join(told)}"
        self._feed.record(
            now,
            EventKind.RELEASE,
            session.session_id,
            f"{RELEASE_REASON}: {tokens:,} tokens held{where}",
            tenant=session.tenant,
        )
        return release, written
