"""The simulated worker's `POST /v1/responses`, driven by the unchanged `openai` client:
vLLM 0.32's shapes, its store and `previous_response_id` chaining, on the chat engine path."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from appliance.sim.serving import ThreadedWorker
from appliance.sim.worker import WorkerConfig

MODEL = "sim-model"


@pytest.fixture(scope="module")
def sim_worker() -> Iterator[ThreadedWorker]:
    config = WorkerConfig(
        served_model_name=MODEL,
        port=0,
        block_size=16,
        num_gpu_blocks=512,
        max_model_len=4096,
        time_scale=0.02,
    )
    with ThreadedWorker(config) as worker:
        yield worker


def _client(worker: ThreadedWorker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.base_url}/v1", api_key="none", max_retries=0)


def test_three_chained_turns_hit_the_cache(sim_worker: ThreadedWorker) -> None:
    c = _client(sim_worker)
    first = c.responses.create(
        model=MODEL, input="alpha beta " * 40, max_output_tokens=8, instructions="be brief"
    )
    assert first.id.startswith("resp_") and first.status == "incomplete"  # max_output_tokens
    assert first.output[0].type == "message" and first.output_text
    assert first.usage is not None and first.usage.output_tokens == 8
    # Instructions do not carry over (vLLM drops the stored system messages): sent again.
    second = c.responses.create(
        model=MODEL,
        input="gamma",
        max_output_tokens=8,
        instructions="be brief",
        previous_response_id=first.id,
    )
    assert second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 64
    with c.responses.create(
        model=MODEL,
        input="delta",
        max_output_tokens=8,
        instructions="be brief",
        previous_response_id=second.id,
        stream=True,
    ) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert done.usage is not None and done.usage.input_tokens > second.usage.input_tokens
    assert done.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens - 16
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == done.output_text


def test_unknown_previous_response_is_vllms_404(sim_worker: ThreadedWorker) -> None:
    r = httpx.post(
        f"{sim_worker.base_url}/v1/responses",
        json={"model": MODEL, "input": "hi", "previous_response_id": "resp_gone"},
    )
    assert r.status_code == 404
    assert r.json() == {
        "error": {
            "message": "Response with id 'resp_gone' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }


def test_bad_input_is_a_400(sim_worker: ThreadedWorker) -> None:
    r = httpx.post(
        f"{sim_worker.base_url}/v1/responses", json={"model": MODEL, "input": [{"type": "bogus"}]}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
