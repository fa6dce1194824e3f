"""A session's end keeps the prefix its agent's other sessions use: `appliance up` with its
default residency settings on one worker, on the simulated engine (the default H200-sized
pool) and on vLLM's CPU build (a 64 MiB pool of the tiny model's KV), both nearly empty.

An agent's session (a 2,000-token system prompt, then its task) ends when its task closes;
the idle reaper then puts what only that session used first in the worker's eviction
order. Two unrelated turns follow, taking blocks from the head of that order. The agent's
next session, with the same system prompt, finds it cached: the system prompt was kept
behind everything else, not evicted first with the rest of the ended session.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.test_reaper import Reaped, cached, prompt_tokens, text
from tests.running import add_key, appliance_process, eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
SYSTEM_WORDS = 400
"""About 2,000 tokens of the tiny model's tokenizer."""
BLOCK = 32
"""The appliance's default block size: the system prompt's last partial block is not cached."""


@pytest.fixture(scope="module", params=["sim", pytest.param("vllm", marks=pytest.mark.vllm)])
def agent_box(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Reaped]:
    data_dir = tmp_path_factory.mktemp(f"shared-prefix-{request.param}")
    key, ops = add_key(data_dir, "alice"), add_key(data_dir, "ops", "--admin")
    model_dir = request.getfixturevalue("tiny_model_dir")  # the sim takes its tokenizer
    env = {"APPLIANCE_ENGINE__MODEL": str(model_dir), "APPLIANCE_ENGINE__MAX_MODEL_LEN": "4096"}
    if request.param == "vllm":
        env["APPLIANCE_ENGINE__PYTHON"] = request.getfixturevalue("vllm_python")
        env["APPLIANCE_ENGINE__KV_CACHE_MEMORY_BYTES"] = str(64 * 2**20)
    with appliance_process(data_dir, engine=request.param, workers=1, env=env) as up:
        yield Reaped(
            up.url,
            key,
            ops,
            model_dir.name,
            f"http://127.0.0.1:{up.base_port}",
            data_dir / "ledger.db",
        )


def task(app: Reaped, task_id: str, event: str | None = None) -> None:
    path = f"/v1/tasks/{task_id}/events" if event else "/v1/tasks"
    body = {"type": event, "verified": True} if event else {"task_id": task_id}
    r = httpx.post(f"{app.url}{path}", json=body, headers={"Authorization": f"Bearer {app.key}"})
    assert r.status_code in (200, 201), r.text


def test_an_ended_sessions_system_prompt_stays_cached_for_the_next(agent_box: Reaped) -> None:
    app = agent_box
    system = {"role": "system", "content": text(70, SYSTEM_WORDS)}
    ask = {"role": "user", "content": text(71, 60)}
    user_tokens = prompt_tokens(app.turn("probe", [ask]))  # the user message, templated
    task(app, "agent-1")
    first = app.turn("agent-1", [system, ask], **{"X-Task-ID": "agent-1"})
    task(app, "agent-1", "succeeded")
    ended = eventually(
        lambda: app.rows(
            "SELECT count(*) FROM residency_events WHERE session_id = 'alice/agent-1'"
            " AND reason LIKE '%its task closed%'"
        )[0][0],
        lambda n: n > 0,
    )
    assert ended == 1  # the reaper has ended the session: its KV went first in the order
    for seed in (72, 73):  # unrelated prompts, each about the size of the ended session's
        app.turn(f"other-{seed}", [{"role": "user", "content": text(seed, SYSTEM_WORDS // 2)}])
    task(app, "agent-2")
    second = app.turn(
        "agent-2", [system, {"role": "user", "content": text(74, 70)}], **{"X-Task-ID": "agent-2"}
    )
    system_tokens = prompt_tokens(first) - user_tokens  # give or take a template's marks
    print(f"next session: {cached(second)} of {prompt_tokens(second)} tokens cached")
    assert system_tokens > 1900
    assert cached(second) >= system_tokens - 2 * BLOCK
