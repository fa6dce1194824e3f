"""The state client and the poll loop, without Textual: requests, errors as one line, the
backoff, an outage and its recovery, and finding the operator key in the data dir."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from appliance.api.admin.schemas import AdminStateView
from tests.source_ast import parse_source
from tests.tui.fakes import ADMIN_KEY, FakeAppliance, json_reply, make_state
from tui.client import (
    Backoff,
    BadPayload,
    KeyRefused,
    KeySource,
    Lost,
    Poller,
    Refused,
    StateClient,
    Unreachable,
    console_key,
    fetch_state,
    find_admin_key,
    resolve_api_key,
)

ROOT = Path(__file__).resolve().parents[2]


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_state_is_read_with_the_operator_key(fake: FakeAppliance) -> None:
    async def go() -> AdminStateView:
        client = StateClient(fake.url, ADMIN_KEY)
        try:
            return await client.state()
        finally:
            await client.aclose()

    state = run(go())
    assert len(state.sessions) == len(fake.state["sessions"])
    assert (
        state.sessions[0].resident_tokens.gpu == fake.state["sessions"][0]["resident_tokens"]["gpu"]
    )
    assert fake.requests[-1].authorization == f"Bearer {ADMIN_KEY}"
    assert fake.requests[-1].path == "/admin/v1/state"


def test_a_wrong_key_is_the_servers_own_words(fake: FakeAppliance) -> None:
    async def go() -> None:
        client = StateClient(fake.url, "sk-wrong")
        try:
            await client.state()
        finally:
            await client.aclose()

    with pytest.raises(Refused) as err:
        run(go())
    assert err.value.status == 401
    assert err.value.message == "401 Unauthorized: missing or unknown API key"


def test_nobody_listening_is_unreachable() -> None:
    fake = FakeAppliance().up()
    fake.down()

    async def go() -> None:
        client = StateClient(fake.url, ADMIN_KEY, timeout_s=1)
        try:
            await client.state()
        finally:
            await client.aclose()

    with pytest.raises(
        Unreachable, match=r"cannot reach http://127\.0\.0\.1:\d+: connection refused"
    ):
        run(go())


def test_a_snapshot_of_another_shape_says_where(fake: FakeAppliance) -> None:
    broken = make_state()
    del broken["sessions"][0]["tenant"]
    fake.set_state(broken)

    async def go() -> None:
        client = StateClient(fake.url, ADMIN_KEY)
        try:
            await client.state()
        finally:
            await client.aclose()

    with pytest.raises(
        BadPayload, match=r"missing required field `tenant` - at `\$\.sessions\[0\]`"
    ):
        run(go())


def test_release_shows_a_404_as_the_server_says_it(fake: FakeAppliance) -> None:
    async def go() -> None:
        client = StateClient(fake.url, ADMIN_KEY)
        try:
            await client.release_session("sess/1 x")
        finally:
            await client.aclose()

    with pytest.raises(Refused) as err:
        run(go())
    assert err.value.status == 404 and err.value.message == "404 Not Found"
    assert fake.requests[-1].method == "POST"
    assert fake.requests[-1].path == "/admin/v1/sessions/sess%2F1%20x/release"


def test_release_reads_the_answer(fake: FakeAppliance) -> None:
    fake.routes[("POST", "/admin/v1/sessions/s1/release")] = json_reply(
        200, {"session_id": "s1", "released_tokens": 4096}
    )

    async def go() -> int | None:
        client = StateClient(fake.url, ADMIN_KEY)
        try:
            return (await client.release_session("s1")).released_tokens
        finally:
            await client.aclose()

    assert run(go()) == 4096


def test_release_and_detail_name_the_sessions_tenant(fake: FakeAppliance) -> None:
    fake.routes[("POST", "/admin/v1/sessions/s%2F1/release?tenant=acme")] = json_reply(
        200, {"session_id": "s/1", "tenant": "acme", "released_tokens": 64}
    )
    fake.routes[("GET", "/admin/v1/sessions/s%2F1?tenant=acme")] = json_reply(
        200, {"residency": [{"worker": "w1", "tokens": 64, "bytes": 8192}], "turns": []}
    )

    async def go() -> tuple[int | None, list[str]]:
        client = StateClient(fake.url, ADMIN_KEY)
        try:
            released = await client.release_session("s/1", "acme")
            detail = await client.session_detail("s/1", "acme")
            return released.released_tokens, [r.worker for r in detail.residency]
        finally:
            await client.aclose()

    assert run(go()) == (64, ["w1"])


def test_backoff_doubles_to_its_cap_and_resets() -> None:
    b = Backoff(first_s=0.5, max_s=3.0)
    assert [b.next_delay() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert b.attempt == 5
    b.reset()
    assert b.next_delay() == 0.5


def test_the_poller_reports_an_outage_once_per_attempt_and_its_end() -> None:
    fake = FakeAppliance(make_state()).up()
    events: list[str] = []
    losts: list[Lost] = []

    async def go() -> None:
        client = StateClient(fake.url, ADMIN_KEY, timeout_s=1)
        poller = Poller(client, interval_s=0.02, backoff=Backoff(first_s=0.02, max_s=0.05))

        def on_state(state: AdminStateView) -> None:
            events.append("state")
            if events.count("state") == 2:
                fake.down()

        def on_lost(lost: Lost) -> None:
            events.append("lost")
            losts.append(lost)
            if len(losts) == 3:
                fake.up()

        def on_restored() -> None:
            events.append("restored")

        task = asyncio.create_task(poller.run(on_state, on_lost, on_restored))
        for _ in range(300):
            await asyncio.sleep(0.01)
            if events.count("state") >= 3:
                break
        task.cancel()
        await client.aclose()

    try:
        run(go())
    finally:
        fake.down()
    assert events[:6] == ["state", "state", "lost", "lost", "lost", "restored"]
    assert events[6] == "state"
    assert [lost.attempt for lost in losts] == [1, 2, 3]
    assert [lost.retry_in_s for lost in losts] == [0.02, 0.04, 0.05]
    assert len({lost.since for lost in losts}) == 1, "one outage, one start time"


def test_the_poller_keeps_its_cadence_and_wakes_on_demand(fake: FakeAppliance) -> None:
    async def go() -> tuple[int, int]:
        client = StateClient(fake.url, ADMIN_KEY)
        poller = Poller(client, interval_s=10.0)
        seen: list[AdminStateView] = []
        task = asyncio.create_task(poller.run(seen.append, lambda lost: None, lambda: None))
        await asyncio.sleep(0.3)
        first = len(seen)
        poller.wake()
        await asyncio.sleep(0.3)
        task.cancel()
        await client.aclose()
        return first, len(seen)

    first, after_wake = run(go())
    assert (first, after_wake) == (1, 2)


def test_fetch_state_for_the_terminal_tables(fake: FakeAppliance) -> None:
    assert fetch_state(fake.url, ADMIN_KEY) == fake.state
    with pytest.raises(Refused, match="401"):
        fetch_state(fake.url, None)


def test_the_admin_key_comes_from_the_data_dir(tmp_path: Path) -> None:
    assert find_admin_key(tmp_path) is None
    (tmp_path / "api-keys.toml").write_text(
        '[keys.default]\nkey = "sk-app-1"\nadmin = false\n\n'
        '[keys.ops]\nkey = "sk-admin-2"\nadmin = true\n'
    )
    assert find_admin_key(tmp_path) == "sk-admin-2"
    assert resolve_api_key("sk-given", tmp_path) == "sk-given"
    assert resolve_api_key(None, tmp_path) == "sk-admin-2"
    (tmp_path / "api-keys.toml").write_text("not toml [")
    assert find_admin_key(tmp_path) is None


def test_a_refused_key_names_its_name_and_data_dir_never_the_key(
    fake: FakeAppliance, tmp_path: Path
) -> None:
    (tmp_path / "api-keys.toml").write_text('[keys.ops]\nkey = "sk-stale"\nadmin = true\n')
    found = console_key(None, tmp_path)
    assert found == ("sk-stale", KeySource("ops", tmp_path))
    with pytest.raises(KeyRefused) as refused:
        fetch_state(fake.url, found[0], key_source=found[1])
    said = refused.value.message
    assert said.startswith("401 Unauthorized: missing or unknown API key. Used operator key")
    assert f'"ops" from {tmp_path}/api-keys.toml (data dir {tmp_path})' in said
    assert "sk-stale" not in said and refused.value.status == 401
    fake.routes[("GET", "/admin/v1/state")] = json_reply(
        403, {"error": {"message": "not an operator key", "code": "not_admin"}}
    )
    with pytest.raises(KeyRefused, match="it is not an operator key") as given:
        fetch_state(fake.url, ADMIN_KEY, key_source=console_key(ADMIN_KEY, None)[1])  # type: ignore[index]
    assert "Used the key given with --key" in given.value.message
    assert "appliance keys add NAME --admin" in given.value.message


def test_the_admin_key_follows_the_data_dir_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "api-keys.toml").write_text('[keys.admin]\nkey = "sk-admin-env"\nadmin = true\n')
    monkeypatch.setenv("APPLIANCE_DATA_DIR", str(tmp_path))
    assert find_admin_key() == "sk-admin-env"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(parse_source(path.read_text(), path.name)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_the_console_imports_only_schemas_of_the_appliance_and_the_client_no_textual() -> None:
    for path in (ROOT / "tui").rglob("*.py"):
        ours = {n for n in _imports(path) if n.split(".")[0] in {"appliance", "cli"}}
        assert ours <= {"appliance.api.admin.schemas"}, f"{path}: {ours}"
    for pure in ("client.py", "tables.py", "format.py"):
        assert not any(
            n.split(".")[0] in {"textual", "rich"} for n in _imports(ROOT / "tui" / pure)
        )
    assert {n.split(".")[0] for n in _imports(ROOT / "appliance/api/admin/schemas.py")} <= {
        "__future__",
        "typing",
        "msgspec",
    }


def test_run_console_without_an_operator_key_says_how_to_get_one(tmp_path: Path) -> None:
    from tui.app import run_console

    with pytest.raises(SystemExit) as done:
        run_console("http://127.0.0.1:9", None, tmp_path)
    message = str(done.value.code)
    assert message.startswith(f"appliance top: no operator key in {tmp_path}/api-keys.toml")
    assert "appliance keys add NAME --admin" in message
