"""The idle reaper live: `appliance up` on one worker with a small KV pool, driven over HTTP.

A session whose turn ends with a short tool call (`X-Tool-Class: api`,
`X-Expected-Tool-Wait-S: 1`) is held in its worker while a flood of other sessions' prompts,
three times the pool, runs through it without a failed or preempted request, and its next
turn finds at least 90 % of its previous prompt cached. A session waiting for an approval
(`X-Expected-Tool-Wait-S: 3600`) is not held: the flood evicts it (near 0 % cached next
time), and the ledger says so with the cause, on its residency rows and its cache receipt.

The pool is 8 MiB of the tiny model's KV (1 KiB per token: 8192 tokens, 255 blocks of 32).
`residency.pressure_from` is 0 so that any use of the pool is pressure: a held session makes
holding a long wait cost more than its re-prefill, as a full pool would on a real one. The
module's appliance runs on the simulated workers (the same pool at the simulated GPU's
bytes per token) and on vLLM's CPU build.
"""

from __future__ import annotations

import random
import sqlite3
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from appliance.engines.clients.metrics import load_snapshot
from tests.running import add_key, appliance_process, eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
KV_BYTES = 8 * 2**20
POOL_TOKENS = 8192
FLOOD_TIMES_POOL = 3
T = TypeVar("T")
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]


@dataclass
class Reaped:
    url: str
    key: str
    ops: str
    model: str
    worker_url: str
    ledger: Path

    def turn(self, session: str, messages: list[dict[str, str]], **headers: str) -> dict[str, Any]:
        r = httpx.post(
            f"{self.url}/v1/chat/completions",
            json={"model": self.model, "messages": messages, "max_tokens": 8, "ignore_eos": True},
            headers={"Authorization": f"Bearer {self.key}", "X-Session-ID": session, **headers},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    def session(self, session: str) -> dict[str, Any]:
        r = httpx.get(
            f"{self.url}/admin/v1/sessions/{session}",
            headers={"Authorization": f"Bearer {self.ops}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    def held_for(self, session: str, tokens: int) -> int:
        """Until the worker reports `tokens` of the session's KV held, or 15 s: what it
        reports. A vLLM worker applies a hold, and reports its pool, at its next scheduling
        step, so a one-token request (no session) nudges it meanwhile."""
        deadline = time.monotonic() + 15
        while (held := self.session(session)["session"]["resident_tokens"]["gpu_held"]) < tokens:
            if time.monotonic() > deadline:
                break
            nudge = {"model": self.model, "prompt": "nudge", "max_tokens": 1}
            auth = {"Authorization": f"Bearer {self.key}"}
            httpx.post(f"{self.url}/v1/completions", json=nudge, headers=auth, timeout=60)
            time.sleep(0.1)
        return held

    def preemptions(self) -> int:
        text = httpx.get(f"{self.worker_url}/metrics", timeout=30).text
        return load_snapshot(text, now=0.0).preemptions

    def rows(self, sql: str, *args: object) -> list[tuple[Any, ...]]:
        with closing(sqlite3.connect(self.ledger)) as db:
            return db.execute(sql, args).fetchall()


ENGINES = ["sim", pytest.param("vllm", marks=pytest.mark.vllm)]
SIM_KV_BYTES_PER_TOKEN = 131_072
"""The bundled H200 profile's (Llama-3-8B): the simulated pool is sized from the bytes."""


@pytest.fixture(scope="module", params=ENGINES)
def reaped(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Reaped]:
    data_dir = tmp_path_factory.mktemp(f"reaper-{request.param}")
    key, ops = add_key(data_dir, "alice"), add_key(data_dir, "ops", "--admin")
    env = {"APPLIANCE_RESIDENCY__PRESSURE_FROM": "0", "APPLIANCE_LOG_LEVEL": "DEBUG"}
    model_dir = request.getfixturevalue("tiny_model_dir")  # the sim takes its tokenizer
    env["APPLIANCE_ENGINE__MODEL"] = str(model_dir)
    env["APPLIANCE_ENGINE__MAX_MODEL_LEN"] = "4096"
    if request.param == "vllm":
        env["APPLIANCE_ENGINE__PYTHON"] = request.getfixturevalue("vllm_python")
        env["APPLIANCE_ENGINE__KV_CACHE_MEMORY_BYTES"] = str(KV_BYTES)
    else:  # the same 8,192-token pool at the simulated GPU's bytes per token
        env["APPLIANCE_ENGINE__KV_CACHE_MEMORY_BYTES"] = str(POOL_TOKENS * SIM_KV_BYTES_PER_TOKEN)
    model = model_dir.name
    started = time.monotonic()
    with appliance_process(data_dir, engine=request.param, workers=1, env=env) as up:
        print(f"appliance up in {time.monotonic() - started:.1f}s")
        worker_url = f"http://127.0.0.1:{up.base_port}"
        yield Reaped(up.url, key, ops, model, worker_url, data_dir / "ledger.db")


def text(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(WORDS)}{rng.randrange(1000)}" for _ in range(n_words))


def prompt_tokens(reply: dict[str, Any]) -> int:
    return int(reply["usage"]["prompt_tokens"])


def cached(reply: dict[str, Any]) -> int:
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


def flood(app: Reaped, words: int, tokens_each: int) -> list[int]:
    """Other sessions' prompts, three times the pool, two at a time: their status codes."""
    n = FLOOD_TIMES_POOL * POOL_TOKENS // tokens_each + 1

    def one(i: int) -> int:
        r = httpx.post(
            f"{app.url}/v1/chat/completions",
            json={
                "model": app.model,
                "messages": [{"role": "user", "content": text(10_000 + i, words)}],
                "max_tokens": 8,
                "ignore_eos": True,
            },
            headers={
                "Authorization": f"Bearer {app.key}",
                "X-Session-ID": f"flood-{i}",
                "X-Tool-Class": "approval",
                "X-Expected-Tool-Wait-S": "3600",
            },
            timeout=300,
        )
        return r.status_code

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, range(n)))


def test_a_short_tool_wait_is_held_through_a_flood_and_an_approval_is_not(reaped: Reaped) -> None:
    app = reaped
    words = 260  # about 1,300 tokens of the tiny model's tokenizer
    api = [{"role": "user", "content": text(1, words)}]
    approval = [{"role": "user", "content": text(2, words)}]
    t0 = time.monotonic()
    first_api = app.turn("api-wait", api, **{"X-Tool-Class": "api", "X-Expected-Tool-Wait-S": "1"})
    # Once the worker reports that hold, the reaper sees the pool under pressure (a turn
    # ending before the report would find it free, as the first seconds of a worker do).
    want = int(0.9 * prompt_tokens(first_api))
    assert app.held_for("api-wait", want) >= want
    first_approval = app.turn(
        "approval-wait",
        approval,
        **{"X-Tool-Class": "approval", "X-Expected-Tool-Wait-S": "3600"},
    )
    n_api, n_approval = prompt_tokens(first_api), prompt_tokens(first_approval)
    assert 800 < n_api < 2000 and 800 < n_approval < 2000, (n_api, n_approval)
    decided = eventually(
        lambda: dict(
            app.rows(
                "SELECT session_id, action FROM residency_events WHERE session_id IN (?, ?) "
                "AND action IN ('hold', 'release', 'evict') ORDER BY at",
                "alice/api-wait",
                "alice/approval-wait",
            )
        ),
        lambda d: len(d) == 2,
    )
    assert decided == {"alice/api-wait": "hold", "alice/approval-wait": "release"}, decided
    held = app.session("api-wait")
    assert held["session"]["resident_tokens"]["gpu_held"] >= 0.9 * n_api, held
    assert held["session"]["held_until"] is not None
    assert any(r["tier"] == "gpu_held" for r in held["residency"]), held["residency"]

    preempted = app.preemptions()
    t1 = time.monotonic()
    statuses = flood(app, words, n_api)
    t2 = time.monotonic()
    assert set(statuses) == {200}, statuses
    assert app.preemptions() == preempted

    # The released session's eviction is recorded while it waits (the reaper looks at the
    # waiting sessions' prefixes every second; its next turn would end its wait first).
    evictions = eventually(
        lambda: app.rows(
            "SELECT reason FROM residency_events WHERE session_id = ? AND action = 'evicted'",
            "alice/approval-wait",
        ),
        bool,
    )
    api += [first_api["choices"][0]["message"], {"role": "user", "content": text(3, 20)}]
    again_api = app.turn("api-wait", api, **{"X-Tool-Class": "api", "X-Expected-Tool-Wait-S": "1"})
    approval += [first_approval["choices"][0]["message"], {"role": "user", "content": text(4, 20)}]
    again_approval = app.turn("approval-wait", approval)
    print(
        f"held (api, 1 s): {cached(again_api)} of {n_api} cached after a flood of "
        f"{len(statuses)} prompts; not held (approval): {cached(again_approval)} of "
        f"{n_approval}; turns {t1 - t0:.1f}s, flood {t2 - t1:.1f}s"
    )
    assert cached(again_api) >= 0.9 * n_api
    assert cached(again_approval) <= 0.1 * n_approval

    assert evictions[0][0].startswith("lru: "), evictions
    # The receipt of its first turn's prefix (written with that turn's end), marked evicted.
    receipt = app.rows(
        "SELECT r.evicted_cause FROM cache_receipts r JOIN turns t ON r.worker = t.worker"
        " AND r.created_at = t.finished_at WHERE t.tenant = 'alice' AND t.session_id = ?"
        " ORDER BY t.started_at LIMIT 1",
        "approval-wait",
    )
    assert receipt == [("lru",)], receipt
    assert app.rows(
        "SELECT COUNT(*) FROM residency_events WHERE session_id = ? AND action IN "
        "('evicted', 'given_back')",
        "alice/api-wait",
    ) == [(0,)]
