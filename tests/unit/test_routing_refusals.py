"""A path the API does not have (404) or a method a route does not take (405) is refused
with the same error JSON as every other refusal; Starlette's own answers were plain text."""

from __future__ import annotations

from types import SimpleNamespace

from starlette.testclient import TestClient

from appliance.api.app import create_api_app
from appliance.api.auth import Keys
from appliance.api.context import ApiContext


def client() -> TestClient:
    ctx = ApiContext(
        desk=SimpleNamespace(),  # type: ignore[arg-type]
        tasks=SimpleNamespace(),  # type: ignore[arg-type]
        tokenizer=SimpleNamespace(),  # type: ignore[arg-type]
        keys=Keys({}),
        clock=SimpleNamespace(now=lambda: 0.0),  # type: ignore[arg-type]
        model="m",
        max_model_len=16,
        state=lambda: None,  # type: ignore[arg-type,return-value]
        healthy=lambda: True,
        ledger_failing=lambda: None,
        metrics=lambda: "",
        costs=lambda: [],
    )
    return TestClient(create_api_app(ctx))


def test_an_unknown_path_is_a_404_in_the_error_json() -> None:
    with client() as http:
        answer = http.get("/v1/nowhere")
    assert answer.status_code == 404
    assert answer.json() == {
        "error": {
            "message": "GET /v1/nowhere: Not Found",
            "type": "not_found_error",
            "param": None,
            "code": "not_found",
        }
    }


def test_a_method_the_route_does_not_take_is_a_405_in_the_error_json_with_allow() -> None:
    with client() as http:
        model_route = http.get("/v1/chat/completions")
        task_route = http.delete("/v1/tasks/t1")
    assert (model_route.status_code, model_route.headers["allow"]) == (405, "POST")
    assert model_route.json()["error"]["code"] == "method_not_allowed"
    assert model_route.json()["error"]["type"] == "invalid_request_error"
    assert task_route.status_code == 405 and "GET" in task_route.headers["allow"]
    assert task_route.json()["error"]["message"] == "DELETE /v1/tasks/t1: Method Not Allowed"
