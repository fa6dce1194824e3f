"""Bytes from the served model: `appliance up` on one worker prices a token of KV at what the
model it serves takes, and says so in the state document per worker.

On vLLM's CPU build serving the tiny test model (2 layers x 2 KV heads x head dim 64 x K and
V x 2 B of bf16) that is 1,024 bytes, and 512 with `engine.kv_cache_dtype: fp8`, which the
worker is started with (vLLM's own metrics say so); on the simulated engine it is the
simulated model's, the bundled GPU profile's Llama-3-8B shape (131,072 bytes), whatever
model directory the simulated workers take their tokenizer from. The same figure prices
the session's resident bytes in the state, the idle reaper's decision (its ledger figures:
the bytes it weighed) and an operator's release.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.test_reaper import Reaped, text
from tests.running import add_key, appliance_process, eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
PER_TOKEN = {"sim": 131_072, "vllm": 1024, "vllm-fp8": 512}
ENGINES = ["sim", *(pytest.param(e, marks=pytest.mark.vllm) for e in ("vllm", "vllm-fp8"))]


@pytest.fixture(scope="module", params=ENGINES)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Reaped, int]]:
    data_dir = tmp_path_factory.mktemp(f"kv-bytes-{request.param}")
    key, ops = add_key(data_dir, "alice"), add_key(data_dir, "ops", "--admin")
    model_dir = request.getfixturevalue("tiny_model_dir")  # the sim takes its tokenizer
    env = {
        "APPLIANCE_ENGINE__MODEL": str(model_dir),
        "APPLIANCE_ENGINE__MAX_MODEL_LEN": "4096",
    }
    engine = request.param.removesuffix("-fp8")
    if engine == "vllm":
        env["APPLIANCE_ENGINE__PYTHON"] = request.getfixturevalue("vllm_python")
        env["APPLIANCE_ENGINE__KV_CACHE_MEMORY_BYTES"] = str(64 * 2**20)
    if request.param.endswith("-fp8"):
        env["APPLIANCE_ENGINE__KV_CACHE_DTYPE"] = "fp8"
    with appliance_process(data_dir, engine=engine, workers=1, env=env) as up:
        worker = f"http://127.0.0.1:{up.base_port}"
        app = Reaped(up.url, key, ops, model_dir.name, worker, data_dir / "ledger.db")
        yield app, PER_TOKEN[request.param]


def admin(app: Reaped, method: str, path: str) -> dict[str, Any]:
    auth = {"Authorization": f"Bearer {app.ops}"}
    r = httpx.request(method, f"{app.url}{path}", timeout=30, headers=auth)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def test_bytes_per_token_come_from_the_served_model(served: tuple[Reaped, int]) -> None:
    app, per_token = served
    state = admin(app, "GET", "/admin/v1/state")
    assert [w["kv_bytes_per_token"] for w in state["workers"]] == [per_token]
    if state["workers"][0]["engine"] == "vllm":  # the dtype vLLM itself reports it stores
        metrics = httpx.get(f"{app.worker_url}/metrics", timeout=30).text
        dtype = "fp8" if per_token == 512 else "auto"
        assert f'cache_dtype="{dtype}"' in metrics
    waits = {"X-Tool-Class": "api", "X-Expected-Tool-Wait-S": "30"}
    app.turn("priced", [{"role": "user", "content": text(1, 300)}], **waits)
    s = eventually(lambda: app.session("priced")["session"], lambda s: s["resident_tokens"]["gpu"])
    tokens = s["resident_tokens"]
    assert tokens["gpu"] >= 256, s
    assert s["resident_bytes"] == {tier: n * per_token for tier, n in tokens.items()}

    decided = eventually(
        lambda: app.rows(
            "SELECT tokens, figures FROM residency_events WHERE session_id = ? AND action IN "
            "('hold', 'release', 'evict', 'demote')",
            "alice/priced",
        ),
        bool,
    )
    assert decided, "the idle reaper decided nothing about the session"
    decided_tokens, raw = decided[-1]
    figures = json.loads(raw)
    assert decided_tokens > 0 and figures["kv_bytes"] == decided_tokens * per_token, figures

    released = admin(app, "POST", "/admin/v1/sessions/priced/release")
    assert released["released_tokens"] == tokens["gpu"], released
    assert released["released_bytes"] == tokens["gpu"] * per_token, released
