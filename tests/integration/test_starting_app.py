"""What the API answers while the appliance starts (api/starting.py), over ASGI."""

from __future__ import annotations

from starlette.testclient import TestClient

from appliance.api.starting import starting_app


def test_while_starting_health_says_so_and_every_route_asks_for_a_retry() -> None:
    client = TestClient(starting_app)
    health = client.get("/health")
    assert (health.status_code, health.json()["status"]) == (503, "starting")
    for method, path in [
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/tasks/t"),
        ("GET", "/admin/v1/state"),
    ]:
        r = client.request(method, path, json={})
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "starting"
