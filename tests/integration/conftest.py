"""Fixtures of the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from appliance.api.auth import Caller
from appliance.config.settings import Settings
from appliance.domain.records import TenantId
from appliance.engines.clients.workers import KvIndexFeed
from appliance.gpu.fake import FakeProbe
from appliance.ledger import LedgerWriter
from appliance.perf.profile import bundled_profile
from appliance.start.wiring import StartedEngines, wire
from tests.fakes import ManualClock


@pytest.fixture
def http(tmp_path: Path) -> Iterator[TestClient]:
    """The wired appliance's API over ASGI with no workers, a real ledger file
    (`client.db`) and two tenants' keys, `a` and `b`."""
    ledger = LedgerWriter.open(tmp_path / "ledger.db")
    try:
        wired = wire(
            Settings(data_dir=tmp_path),
            engines=StartedEngines(lambda: [], "m", 4096, "test:m"),
            ledger=ledger,
            feed=KvIndexFeed(),
            clock=ManualClock(),
            probe=FakeProbe([[]]),
            profile=bundled_profile(),
            keys={"a": Caller(TenantId("a"), False), "b": Caller(TenantId("b"), False)},
            secret=b"s" * 32,
        )
        with TestClient(wired.app) as client:
            client.db = tmp_path / "ledger.db"  # type: ignore[attr-defined]
            yield client
    finally:
        ledger.close()
