"""The simulated worker's `POST /v1/responses`, driven by the unchanged `openai` client:
vLLM 0.32's shapes, its store and `previous_response_id` chaining, on the chat engine path;
function tools called as `function_call` items, whole and streamed, and sent back with their
`function_call_output` (a Codex-style loop), a chain dropping the stored calls as vLLM does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from appliance.sim.entrypoints.serving import ThreadedWorker
from appliance.sim.runtime.worker import WorkerConfig

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


SCHEMA = {"type": "object", "properties": {"target": {"enum": ["src"]}}, "required": ["target"]}
FUNCTIONS: list[Any] = [
    {"type": "function", "name": n, "description": f"{n} in the repo", "parameters": SCHEMA}
    for n in ("read_file", "grep")
]


@pytest.fixture(scope="module")
def tool_worker() -> Iterator[ThreadedWorker]:
    """A worker as `--enable-auto-tool-choice --tool-call-parser hermes`."""
    config = WorkerConfig(
        served_model_name=MODEL,
        port=0,
        block_size=16,
        num_gpu_blocks=512,
        max_model_len=4096,
        time_scale=0.02,
        enable_auto_tool_choice=True,
    )
    with ThreadedWorker(config) as worker:
        yield worker


def _call_and_output(call: Any, result: str) -> list[dict[str, Any]]:
    """What a Codex-style client sends back: the call as it came, and its output."""
    output = {"type": "function_call_output", "call_id": call.call_id, "output": result}
    return [call.model_dump(exclude_none=True), output]


def test_a_function_call_loop_whole_and_streamed(tool_worker: ThreadedWorker) -> None:
    c = _client(tool_worker)
    items: list[Any] = [{"role": "user", "content": "Please grep. " + "alpha beta " * 40}]
    first = c.responses.create(model=MODEL, input=items, tools=FUNCTIONS)
    [call] = first.output
    assert call.type == "function_call" and call.name == "grep" and call.status == "completed"
    assert call.id is not None and call.id.startswith("fc_")
    assert call.call_id.startswith("chatcmpl-tool-") and json.loads(call.arguments) == {
        "target": "src"
    }
    assert first.status == "completed" and first.usage is not None
    items += _call_and_output(call, "3 matches")
    second = c.responses.create(model=MODEL, input=items, tools=FUNCTIONS, max_output_tokens=8)
    assert [item.type for item in second.output] == ["message"]  # a tool result: text
    assert second.usage is not None
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16
    items += [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Now read_file."},
    ]
    with c.responses.create(model=MODEL, input=items, tools=FUNCTIONS, stream=True) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-4:] == [
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    [streamed] = done.output
    assert streamed.type == "function_call" and streamed.name == "read_file"
    assert streamed == events[-2].item and streamed.id == events[2].item.id
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == streamed.arguments
    assert done.usage is not None
    assert done.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens - 16


def test_a_chained_request_drops_the_stored_calls(tool_worker: ThreadedWorker) -> None:
    """As vLLM: the previous response's function calls are not rendered again, only its
    messages' text; so a chained request's prompt is the same as that history sent whole."""
    c = _client(tool_worker)
    ask = {"role": "user", "content": "Please read_file. " + "gamma delta " * 30}
    first = c.responses.create(model=MODEL, input=[ask], tools=FUNCTIONS)
    [call] = first.output
    output = _call_and_output(call, "the file")[1]
    chained = c.responses.create(
        model=MODEL,
        input=[output],
        tools=FUNCTIONS,
        previous_response_id=first.id,
        max_output_tokens=4,
    )
    whole = c.responses.create(
        model=MODEL, input=[ask, output], tools=FUNCTIONS, max_output_tokens=4
    )
    with_call = c.responses.create(
        model=MODEL,
        input=[ask, *_call_and_output(call, "the file")],
        max_output_tokens=4,
        tools=FUNCTIONS,
    )
    assert chained.usage is not None and whole.usage is not None and with_call.usage is not None
    assert chained.usage.input_tokens == whole.usage.input_tokens
    assert with_call.usage.input_tokens > whole.usage.input_tokens


def test_tools_without_a_parser_are_answered_in_text(sim_worker: ThreadedWorker) -> None:
    r = httpx.post(
        f"{sim_worker.base_url}/v1/responses",
        json={"model": MODEL, "input": "grep it", "tools": FUNCTIONS, "max_output_tokens": 4},
    )
    assert r.status_code == 200
    assert [item["type"] for item in r.json()["output"]] == ["message"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tool_choice": "required"}, "Tool choice 'required' must be specified"),
        (
            {"tools": FUNCTIONS, "tool_choice": {"type": "function", "name": "ls"}},
            "Tool choice 'function' not found",
        ),
    ],
)
def test_a_tool_choice_vllm_refuses_is_a_400(
    tool_worker: ThreadedWorker, extra: dict[str, Any], message: str
) -> None:
    r = httpx.post(
        f"{tool_worker.base_url}/v1/responses", json={"model": MODEL, "input": "x", **extra}
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tool_choice" and message in r.json()["error"]["message"]
