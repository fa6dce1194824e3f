"""An operator's session routes: the detail (session, residency, turns) and the release, with
its ledger row, its event, its effect on the state and its refusals."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.testclient import TestClient

from appliance.api.admin.admin_sessions import SessionAdmin
from appliance.api.app import create_api_app
from appliance.api.auth import Caller, Keys
from appliance.api.context import ApiContext
from appliance.domain.block_hash import BlockHasher
from appliance.domain.records import (
    ResidencyEvent,
    SessionId,
    TaskEventType,
    TenantId,
    WorkerId,
)
from appliance.services.operator.events import EventFeed
from appliance.services.operator.session_admin import SessionReleases
from appliance.services.operator.state import session_view
from appliance.services.residency.session_kv import SessionKv
from appliance.services.sessions.sessions import SessionState, SessionTable
from appliance.services.tasks.tasks import TaskBook

KV_BYTES_PER_TOKEN = 1000
OPS = {"Authorization": "Bearer ops"}


@dataclass
class Ledger:
    residency: list[ResidencyEvent] = field(default_factory=list)

    def record_residency_event(self, event: ResidencyEvent) -> Future[None]:
        self.residency.append(event)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def __getattr__(self, name: str) -> Any:
        def acknowledged(*args: Any, **kwargs: Any) -> Future[None]:
            done: Future[None] = Future()
            done.set_result(None)
            return done

        return acknowledged


@dataclass
class Setup:
    http: TestClient
    table: SessionTable
    ledger: Ledger
    feed: EventFeed
    releases: SessionReleases
    reads: list[tuple[str, str, int]]
    held: dict[str, dict[str, dict[WorkerId, int]]]
    """What the KV index holds of each session now, by session id."""


def open_session(table: SessionTable, tenant: str, sid: str, **kw: Any) -> SessionState:
    session = table.open(TenantId(tenant), SessionId(sid), 100.0)
    for key, value in kw.items():
        setattr(session, key, value)
    return session


@pytest.fixture
def setup() -> Iterator[Setup]:
    table = SessionTable(BlockHasher.for_engine("sha256_cbor", 16, "0"))
    ledger, feed = Ledger(), EventFeed()
    releases = SessionReleases(table, ledger, feed, KV_BYTES_PER_TOKEN)  # type: ignore[arg-type]
    reads: list[tuple[str, str, int]] = []
    held: dict[str, dict[str, dict[WorkerId, int]]] = {}

    def turns(tenant: str, sid: str, limit: int) -> list[dict[str, Any]]:
        reads.append((tenant, sid, limit))
        return [{"turn_id": "t-1", "started_at": 90.0, "worker": "w1", "outcome": "ok"}]

    ctx = ApiContext(
        desk=SimpleNamespace(sessions=table),  # type: ignore[arg-type]
        tasks=TaskBook(ledger),  # type: ignore[arg-type]
        tokenizer=SimpleNamespace(),  # type: ignore[arg-type]
        keys=Keys({"ops": Caller(TenantId("ops"), True), "acme": Caller(TenantId("acme"), False)}),
        clock=SimpleNamespace(now=lambda: 130.0),  # type: ignore[arg-type]
        model="sim",
        max_model_len=4096,
        state=lambda: {},
        healthy=lambda: True,
        ledger_failing=lambda: None,
        metrics=lambda: "",
        costs=lambda: [],
        sessions_admin=SessionAdmin(
            releases,
            turns,
            SessionKv(lambda s: held.get(s.session_id, {"gpu": {}, "host": {}}), releases),
        ),
    )
    with TestClient(create_api_app(ctx)) as http:
        yield Setup(http, table, ledger, feed, releases, reads, held)


def test_the_detail_has_the_session_its_residency_and_its_turns(setup: Setup) -> None:
    open_session(
        setup.table,
        "acme",
        "a/b c",
        home=WorkerId("w1"),
        turns=4,
        last_active_at=120.0,
        resident_tokens={WorkerId("w1"): 1024},  # predicted at its last placement: not shown
    )
    setup.held["a/b c"] = {
        "gpu": {WorkerId("w1"): 512, WorkerId("w0"): 0, WorkerId("w2"): 64},
        "host": {WorkerId("w0"): 256},
    }
    r = setup.http.get(
        "/admin/v1/sessions/a%2Fb%20c", params={"tenant": "acme", "turns": 7}, headers=OPS
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["session"]["id"] == "a/b c" and body["session"]["tenant"] == "acme"
    assert body["session"]["idle_s"] == 10.0 and body["session"]["decision"] is None
    assert body["session"]["resident_tokens"] == {"gpu": 512, "host": 256, "gpu_held": 0, "gone": 0}
    assert body["residency"] == [
        {"worker": "w1", "tier": "gpu", "tokens": 512, "bytes": 512 * KV_BYTES_PER_TOKEN},
        {"worker": "w2", "tier": "gpu", "tokens": 64, "bytes": 64 * KV_BYTES_PER_TOKEN},
        {"worker": "w0", "tier": "host", "tokens": 256, "bytes": 256 * KV_BYTES_PER_TOKEN},
    ]
    assert body["turns"][0]["turn_id"] == "t-1"
    assert setup.reads == [("acme", "a/b c", 7)]


def test_the_tenant_may_be_left_out_only_when_one_tenant_has_the_id(setup: Setup) -> None:
    open_session(setup.table, "acme", "s1")
    assert setup.http.get("/admin/v1/sessions/s1", headers=OPS).status_code == 200
    open_session(setup.table, "other", "s1")
    r = setup.http.get("/admin/v1/sessions/s1", headers=OPS)
    assert r.status_code == 400 and r.json()["error"]["code"] == "session_ambiguous"
    r = setup.http.get("/admin/v1/sessions/s1", params={"tenant": "other"}, headers=OPS)
    assert r.status_code == 200 and r.json()["session"]["tenant"] == "other"


@pytest.mark.parametrize(
    ("method", "path", "headers", "status", "code"),
    [
        ("GET", "/admin/v1/sessions/nope", OPS, 404, "session_not_found"),
        ("POST", "/admin/v1/sessions/nope/release", OPS, 404, "session_not_found"),
        ("GET", "/admin/v1/sessions/s1?tenant=other", OPS, 404, "session_not_found"),
        ("GET", "/admin/v1/sessions/s1?turns=0", OPS, 400, "invalid_value"),
        ("GET", "/admin/v1/sessions/s1", {"Authorization": "Bearer acme"}, 403, "not_admin"),
        ("POST", "/admin/v1/sessions/s1/release", {}, 401, "invalid_api_key"),
    ],
)
def test_refusals(
    setup: Setup, method: str, path: str, headers: dict[str, str], status: int, code: str
) -> None:
    open_session(setup.table, "acme", "s1")
    r = setup.http.request(method, path, headers=headers)
    assert (r.status_code, r.json()["error"]["code"]) == (status, code)
    assert setup.ledger.residency == [] and len(setup.feed) == 0


def test_release_records_the_decision_the_ledger_row_and_the_event(setup: Setup) -> None:
    session = open_session(
        setup.table,
        "acme",
        "s1",
        home=WorkerId("w1"),
        turns=3,
        resident_tokens={WorkerId("w1"): 2048},  # predicted at its last placement
    )
    setup.held["s1"] = {"gpu": {WorkerId("w1"): 1536, WorkerId("w0"): 512}, "host": {}}
    shown = setup.http.get("/admin/v1/sessions/s1", headers=OPS).json()["session"]
    assert shown["resident_tokens"]["gpu"] == 1536  # what the state shows: the KV index's
    r = setup.http.post("/admin/v1/sessions/s1/release?tenant=acme", headers=OPS)
    assert r.status_code == 200, r.text
    assert r.json() == {
        "session_id": "s1",
        "tenant": "acme",
        "released_tokens": 1536,  # the same figure, not the placement's prediction
        "released_bytes": shown["resident_bytes"]["gpu"],
        "decision": "released",
        "reason": "released by operator",
    }
    (row,) = setup.ledger.residency
    assert (row.session_id, row.worker, row.action, row.tokens, row.at) == (
        "acme/s1",
        "w1",
        "release",
        1536,
        130.0,
    )
    (event,) = setup.feed.recent()
    assert (event["kind"], event["subject"], event["tenant"]) == ("release", "s1", "acme")
    assert "1,536 tokens held on w1" in event["detail"]
    kv = SessionKv(lambda s: {}, setup.releases)
    shown = session_view(session, 130.0, KV_BYTES_PER_TOKEN, kv.now(session))
    assert (shown.decision, shown.reason) == ("released", "released by operator")

    again = setup.http.post("/admin/v1/sessions/s1/release", headers=OPS)
    assert again.status_code == 200 and len(setup.ledger.residency) == 1, "nothing new"

    session.turns += 1  # the session's next turn ends the release
    assert setup.releases.in_effect(session) is None
    assert session_view(session, 131.0, KV_BYTES_PER_TOKEN, kv.now(session)).decision is None


def test_a_session_with_a_request_in_flight_is_not_released(setup: Setup) -> None:
    session = open_session(setup.table, "acme", "s1", in_flight=1)
    r = setup.http.post("/admin/v1/sessions/s1/release", headers=OPS)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "session_in_flight")
    assert setup.ledger.residency == [] and len(setup.feed) == 0
    session.in_flight = 0
    assert setup.http.post("/admin/v1/sessions/s1/release", headers=OPS).status_code == 200


def test_cancelling_a_task_tree_is_one_event(setup: Setup) -> None:
    book = TaskBook(setup.ledger, setup.feed)  # type: ignore[arg-type]
    acme = TenantId("acme")
    book.create(acme, "root", 1.0)
    book.create(acme, "a", 1.0, parent_id="root")
    book.create(acme, "b", 1.0, parent_id="root")
    book.event(acme, "b", TaskEventType.SUCCEEDED, 2.0)
    book.cancel(acme, "root", 3.0)
    book.create(acme, "solo", 4.0)
    book.event(acme, "solo", TaskEventType.CANCELLED, 5.0)
    events = setup.feed.recent()
    assert [(e["kind"], e["subject"], e["tenant"]) for e in events] == [
        ("task_cancelled", "solo", "acme"),
        ("task_cancelled", "root", "acme"),
    ]
    assert "1 open descendant" in events[1]["detail"]
