"""A session's residency as the state shows it is the KV index's view now, not the view the
router predicted when it last placed the session: an eviction after the turn shows at once,
and blocks a worker moved to host memory show in the host tier."""

from __future__ import annotations

from appliance.domain.block_hash import BlockHasher, HashAlgo
from appliance.domain.kv_events import BlockRemoved, BlockStored, Medium
from appliance.domain.kv_index import KvIndex
from appliance.domain.records import SessionId, TaskId, TenantId, WorkerId
from appliance.policy.routing.core import default_profile
from appliance.services.router import Router, TurnRequest
from appliance.services.sessions import SessionTable
from tests.fakes import AckLedger, LinearCost, ManualClock, RouterWorker

W0, W1 = WorkerId("w0"), WorkerId("w1")


def placed_session() -> tuple[Router, KvIndex, tuple[int, ...]]:
    """A router over a real index, and a session placed once with a 100-token prompt (six
    full blocks of 16): the event hashes of its chain."""
    index = KvIndex()
    workers = [RouterWorker(w, client=None) for w in (W0, W1)]
    router = Router(
        workers=lambda: workers, index=index, sessions=SessionTable(BlockHasher(
            HashAlgo.SHA256_CBOR, 16)), cost=LinearCost(), profile=default_profile(),
        ledger=AckLedger(), clock=ManualClock(), tenant_salt=lambda t, c: f"salt-{t}", model="m",
    )  # fmt: skip
    session = router.sessions.open(TenantId("a"), SessionId("s"), 0.0)
    turn = TurnRequest(TenantId("a"), "/v1/completions", {"model": "m"}, list(range(100)),
                       TaskId("a/t"), SessionId("s"))  # fmt: skip
    router.place(turn, session)
    assert session.chain is not None
    return router, index, session.chain.event_hashes


def stored(hashes: tuple[int, ...], medium: Medium = Medium.GPU) -> BlockStored:
    return BlockStored(hashes, None, (), 16, medium=medium)


def test_residency_follows_the_index_after_the_placement() -> None:
    router, index, chain = placed_session()
    session = router.sessions.get(TenantId("a"), SessionId("s"))
    assert session is not None and len(chain) == 6
    assert router.residency(session) == {"gpu": {}, "host": {}}, "nothing held before the turn"
    index.apply(W0, stored(chain))  # the turn ran on w0: its six blocks are cached
    assert router.residency(session) == {"gpu": {W0: 96}, "host": {}}
    index.apply(W0, BlockRemoved(chain[4:]))  # evicted while the session waits on a tool
    assert router.residency(session) == {"gpu": {W0: 64}, "host": {}}
    index.apply(W1, stored(chain[:3], Medium.CPU))  # another worker's host copy of a prefix
    assert router.residency(session) == {"gpu": {W0: 64}, "host": {W1: 48}}


def test_a_session_never_placed_holds_nothing() -> None:
    router, _, _ = placed_session()
    fresh = router.sessions.open(TenantId("a"), SessionId("new"), 0.0)
    assert router.residency(fresh) == {"gpu": {}, "host": {}}
