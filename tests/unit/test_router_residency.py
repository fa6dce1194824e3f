"""A session's residency as the state shows it is the KV index's view now, not the view the
placement predicted when it last placed the session: an eviction after the turn shows at once,
and blocks a worker moved to host memory show in the host tier."""

from __future__ import annotations

from appliance.domain.kv_events import BlockRemoved, BlockStored, Medium
from appliance.domain.kv_index import KvIndex
from appliance.domain.records import SessionId, TaskId, TenantId, WorkerId
from appliance.services.turns.turn import TurnRequest
from tests.fakes import RouterWorker, Wired, wired_desk

W0, W1 = WorkerId("w0"), WorkerId("w1")


def placed_session() -> tuple[Wired, tuple[int, ...]]:
    """A desk over a real index, and a session placed once with a 100-token prompt (six
    full blocks of 16): the event hashes of its chain."""
    wired = wired_desk([RouterWorker(w, client=None) for w in (W0, W1)], index=KvIndex())
    session = wired.desk.sessions.open(TenantId("a"), SessionId("s"), 0.0)
    turn = TurnRequest(
        TenantId("a"),
        "/v1/completions",
        {"model": "m"},
        list(range(100)),
        TaskId("a/t"),
        SessionId("s"),
    )
    placer = wired.desk.placer
    placer.commit(session, placer.place(turn, session))
    assert session.chain is not None
    return wired, session.chain.event_hashes


def stored(hashes: tuple[int, ...], medium: Medium = Medium.GPU) -> BlockStored:
    return BlockStored(hashes, None, (), 16, medium=medium)


def test_residency_follows_the_index_after_the_placement() -> None:
    wired, chain = placed_session()
    index, residency = wired.index, wired.desk.placer.residency
    session = wired.desk.sessions.get(TenantId("a"), SessionId("s"))
    assert session is not None and len(chain) == 6
    assert residency(session) == {"gpu": {}, "host": {}}, "nothing held before the turn"
    index.apply(W0, stored(chain))  # the turn ran on w0: its six blocks are cached
    assert residency(session) == {"gpu": {W0: 96}, "host": {}}
    index.apply(W0, BlockRemoved(chain[4:]))  # evicted while the session waits on a tool
    assert residency(session) == {"gpu": {W0: 64}, "host": {}}
    index.apply(W1, stored(chain[:3], Medium.CPU))  # another worker's host copy of a prefix
    assert residency(session) == {"gpu": {W0: 64}, "host": {W1: 48}}


def test_a_session_never_placed_holds_nothing() -> None:
    wired, _ = placed_session()
    fresh = wired.desk.sessions.open(TenantId("a"), SessionId("new"), 0.0)
    assert wired.desk.placer.residency(fresh) == {"gpu": {}, "host": {}}
