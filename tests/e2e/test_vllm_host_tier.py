"""The host tier inside stock vLLM, on its CPU build (issue 38): `appliance up --engine vllm`
with `engine.kv_host_bytes`, one worker whose KV pool holds 8,192 tokens and whose host
tier eight times that (vLLM's OffloadingConnector beside the retention connector, the
copies the appliance's own offloading spec's, since vLLM's refuse this device).

A session whose turn ends with a test run (60 s expected) is demoted by the reaper, as on
the simulated engine (tests/e2e/test_demote.py): the worker's retention reports show a host
tier, and a copy back is cheaper than holding the prefix in a pool under pressure. A flood
of other sessions, three times the pool, runs meanwhile. The state document shows the
demoted session's prefix on the worker's host tier; its client then says the test run is
over, and the ledger records the restore. Its next turn finds at least 90 % of its
previous prompt cached, served from the host tier by vLLM's own counters
(`prompt_tokens_cached_by_source{source="host"}`), and its answer at temperature 0, with
each token's log-probabilities (to float rounding), is the answer the same prompt gets with
its prefix on the GPU: the KV came back intact.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.engines.clients.metrics import load_snapshot
from tests.e2e.test_reaper import Reaped, flood, text
from tests.running import add_key, appliance_process, eventually

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.timeout(900)]
KV_BYTES = 8 * 2**20
"""8,192 tokens of the tiny model (1,024 bytes a token), 255 usable blocks of 32."""
HOST_BYTES = 8 * KV_BYTES
API_WAIT = {"X-Tool-Class": "api", "X-Expected-Tool-Wait-S": "1"}
TEST_RUN = {"X-Tool-Class": "test", "X-Expected-Tool-Wait-S": "60"}
LOGPROB_TOLERANCE = 1e-3
"""Between the same prompt's answers from host-loaded and GPU-resident KV: the float sums
differ in order where the GPU's cache hit is longer than the host's (its tail is computed
in other chunks); corrupt KV moves them by far more."""
WORDS = 500  # about 2,500 tokens: the session's prompt and two flood prompts fit in the pool


@pytest.fixture(scope="module")
def hosted(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, vllm_python: str
) -> Iterator[Reaped]:
    yield from host_tier_up(tmp_path_factory, tiny_model_dir, vllm_python)


def host_tier_up(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, vllm_python: str
) -> Iterator[Reaped]:
    """`appliance up --engine vllm`, one worker with a host tier (tests/gpu too)."""
    data_dir = tmp_path_factory.mktemp("host-tier-vllm")
    key, ops = add_key(data_dir, "alice"), add_key(data_dir, "ops", "--admin")
    env = {
        "APPLIANCE_RESIDENCY__PRESSURE_FROM": "0",
        "APPLIANCE_LOG_LEVEL": "DEBUG",
        "APPLIANCE_ENGINE__MODEL": str(tiny_model_dir),
        "APPLIANCE_ENGINE__PYTHON": vllm_python,
        "APPLIANCE_ENGINE__MAX_MODEL_LEN": "4096",
        "APPLIANCE_ENGINE__KV_CACHE_MEMORY_BYTES": str(KV_BYTES),
        "APPLIANCE_ENGINE__KV_HOST_BYTES": str(HOST_BYTES),
    }
    with appliance_process(data_dir, engine="vllm", workers=1, env=env) as up:
        worker_url = f"http://127.0.0.1:{up.base_port}"
        yield Reaped(up.url, key, ops, tiny_model_dir.name, worker_url, data_dir / "ledger.db")


def turn(
    app: Reaped, session: str, messages: list[dict[str, str]], headers: dict[str, str]
) -> dict[str, Any]:
    """A turn at temperature 0 with each token's log-probabilities: the answer's message,
    its tokens' log-probabilities and its usage."""
    body = {
        "model": app.model,
        "messages": messages,
        "max_tokens": 8,
        "ignore_eos": True,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    r = httpx.post(
        f"{app.url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {app.key}", "X-Session-ID": session, **headers},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    reply = r.json()
    choice = reply["choices"][0]
    return {
        "message": {"role": "assistant", "content": choice["message"]["content"]},
        "logprobs": [
            (t["token"], t["logprob"], [(a["token"], a["logprob"]) for a in t["top_logprobs"]])
            for t in choice["logprobs"]["content"]
        ],
        "prompt": reply["usage"]["prompt_tokens"],
        "cached": reply["usage"]["prompt_tokens_details"]["cached_tokens"],
    }


def from_host(app: Reaped) -> int:
    """Prompt tokens the worker has served from its host tier (vLLM's own counter)."""
    metrics = httpx.get(f"{app.worker_url}/metrics", timeout=30).text
    return load_snapshot(metrics, now=0.0).prompt_tokens_cached_by_source.get("host", 0)


def session_tiers(app: Reaped, session: str) -> dict[str, int]:
    """The session's tokens by tier, as the state document shows it."""
    r = httpx.get(
        f"{app.url}/admin/v1/state", headers={"Authorization": f"Bearer {app.ops}"}, timeout=30
    )
    assert r.status_code == 200, r.text
    (view,) = [s for s in r.json()["sessions"] if (s["tenant"], s["id"]) == ("alice", session)]
    tiers: dict[str, int] = view["resident_tokens"]
    return tiers


def test_a_demoted_session_comes_back_from_vllms_host_tier_with_its_kv_intact(
    hosted: Reaped,
) -> None:
    demote_and_restore(hosted)


def demote_and_restore(app: Reaped) -> None:
    """The scenario of this module's docstring, on `app` (tests/gpu runs it on CUDA)."""
    auth = {"Authorization": f"Bearer {app.key}"}
    created = httpx.post(f"{app.url}/v1/tasks", json={"task_id": "fix"}, headers=auth)
    assert created.status_code == 201, created.text
    demoted = [{"role": "user", "content": text(82, WORDS)}]
    first = turn(app, "demoted", demoted, {**TEST_RUN, "X-Task-ID": "fix"})
    n = first["prompt"]
    decided = eventually(
        lambda: app.rows(
            "SELECT action FROM residency_events WHERE session_id = ?"
            " AND action IN ('hold', 'demote', 'release', 'evict')",
            "alice/demoted",
        ),
        lambda rows: len(rows) == 1,
    )
    assert decided == [("demote",)], decided

    statuses = flood(app, WORDS // 2, n // 2)
    assert set(statuses) == {200}, statuses
    tiers = eventually(lambda: session_tiers(app, "demoted"), lambda t: t["host"] >= 0.9 * n)
    assert tiers["gpu"] < 0.5 * n, tiers  # the flood took its GPU blocks (they went first)

    done = {"type": "tool_finished", "tool_class": "test"}
    r = httpx.post(f"{app.url}/v1/tasks/fix/events", json=done, headers=auth)
    assert r.status_code == 200, r.text
    restored = eventually(
        lambda: app.rows(
            "SELECT action FROM residency_events WHERE session_id = ? AND action = 'restore'",
            "alice/demoted",
        ),
        lambda rows: len(rows) == 1,
    )
    assert restored == [("restore",)]

    before = from_host(app)
    demoted += [first["message"], {"role": "user", "content": text(83, 20)}]
    again = turn(app, "demoted", demoted, {**TEST_RUN, "X-Task-ID": "fix"})
    served = from_host(app) - before
    print(f"demoted: {again['cached']} of {n} cached, {served} from the host tier")
    assert again["cached"] >= 0.9 * n
    assert served >= 0.9 * n

    reference = turn(app, "reference", demoted, API_WAIT)  # the same prompt, from the GPU
    assert from_host(app) - before == served
    assert reference["cached"] >= again["cached"]
    assert again["message"] == reference["message"]
    assert tokens_of(again) == tokens_of(reference)
    drift = logprob_gap(again, reference)  # float order: the GPU's hit is longer by a block
    other = turn(app, "other", [*demoted[:-1], {"role": "user", "content": text(84, 20)}], API_WAIT)
    apart = logprob_gap(other, reference)
    print(f"log-probabilities: {drift:.2g} from the GPU's; another prompt's {apart:.2g}")
    assert drift <= LOGPROB_TOLERANCE < apart


def tokens_of(answer: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """Each generated token, and its top candidates."""
    return [(token, [t for t, _ in top]) for token, _, top in answer["logprobs"]]


def logprob_gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest difference between two answers' log-probabilities, token by token."""
    pairs = zip(a["logprobs"], b["logprobs"], strict=True)
    return max(
        abs(x - y)
        for (_, lx, top_x), (_, ly, top_y) in pairs
        for x, y in [(lx, ly), *((p, q) for (_, p), (_, q) in zip(top_x, top_y, strict=True))]
    )


def test_a_closed_tasks_session_leaves_vllms_host_tier(hosted: Reaped) -> None:
    drop_at_task_end(hosted)


def drop_at_task_end(app: Reaped) -> None:
    """A session pushed off the GPU by a flood, its prompt in vLLM's host tier (which stores
    every computed block), then its task succeeds: the reaper's `RetentionEvictFirst(
    drop_host=True)` takes its copies out of the tier, so the same prompt in a new session
    loads next to nothing from there (before, vLLM's LRU kept them until other copies
    needed the room). On `app` (tests/gpu runs it on CUDA)."""
    auth = {"Authorization": f"Bearer {app.key}"}
    created = httpx.post(f"{app.url}/v1/tasks", json={"task_id": "done"}, headers=auth)
    assert created.status_code == 201, created.text
    prompt = [{"role": "user", "content": text(85, WORDS)}]
    n = turn(app, "closing", prompt, {**TEST_RUN, "X-Task-ID": "done"})["prompt"]
    assert set(flood(app, WORDS // 2, n // 2)) == {200}
    tiers = eventually(lambda: session_tiers(app, "closing"), lambda t: t["host"] >= 0.9 * n)
    assert tiers["gpu"] < 0.5 * n, tiers
    r = httpx.post(f"{app.url}/v1/tasks/done/events", json={"type": "succeeded"}, headers=auth)
    assert r.status_code == 200, r.text
    ended = eventually(
        lambda: app.rows(
            "SELECT reason FROM residency_events WHERE session_id = ? AND reason LIKE ?",
            "alice/closing",
            "session_ended%",
        ),
        lambda rows: len(rows) == 1,
    )
    assert len(ended) == 1, ended
    before = from_host(app)
    probe = turn(app, "probe", prompt, API_WAIT)
    served = from_host(app) - before
    print(f"after its task: {probe['cached']} of {n} cached, {served} from the host tier")
    assert served < 0.1 * n
