"""vLLM 0.32's `POST /v1/responses` (the OpenAI Responses API), for the simulated worker.

Model of the world (vLLM `entrypoints/openai/responses/`, without Harmony and built-in
tools): the request becomes chat messages (`construct_input_messages`, in
`domain/responses_input.py`: the instructions as a system message, then with
`previous_response_id` the stored response's own messages less their system ones and its
output text as assistant messages, then the input: a string is one user message, a list of
items each a message, `function_call` items the assistant's tool calls and
`function_call_output` items tool messages) and its function `tools` and `tool_choice` chat
ones (`domain/responses_tools.py`), and it runs as a chat turn on the same engine path
(template with the tools, prefix cache, scheduling, and the tool-call rule of
`tool_calls.py`, with `parallel_tool_calls`; a worker without auto tool choice has no
tool-call parser, and answers in text). The answer is a `response` object whose `output`
holds one assistant message, or a `function_call` item per tool call
(`responses_events.py`), and whose `usage` counts `input_tokens` (with
`input_tokens_details.cached_tokens`) and `output_tokens`; streamed, the same as SSE events
`event: <type>` / `data: {...}` (`response.created`, `response.in_progress`, each item's
added, delta and done events, then `response.completed` carrying the whole response),
numbered by `sequence_number`, with no `[DONE]`. With `store` (vLLM's default, under
`VLLM_ENABLE_RESPONSES_API_STORE=1`) a response and its messages stay in this worker's
memory under its id `resp_...`, the oldest dropped past `STORE_LIMIT`; a request chained to
it gets its messages and its output text, not its function calls (vLLM drops them too).
An unknown `previous_response_id` is a 404 `invalid_request_error` with `param:
"response_id"`. A restarted worker knows none.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from appliance.domain.responses_input import ResponsesInputError, input_messages, output_texts
from appliance.domain.responses_tools import chat_tool_choice, chat_tools
from appliance.sim.entrypoints.api_errors import ApiError, vllm_validation_error
from appliance.sim.entrypoints.protocol import (
    ChatCompletionRequest,
    check_prompt_tokens,
    random_uuid,
    read_json_body,
    validate_body,
)
from appliance.sim.entrypoints.responses_events import ResponsesStream, stream_event, whole_output
from appliance.sim.entrypoints.tool_calls import Plan, attach, plan_reply

STORE_LIMIT = 10_000
_PASSED_ON = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "cache_salt",
    "priority", "session_id", "request_id", "vllm_xargs", "parallel_tool_calls",
)  # fmt: skip
"""Fields that mean the same to the chat turn a Responses request runs as."""


class ResponsesApi:
    """`POST /v1/responses` on one simulated worker, and its store of responses."""

    def __init__(self, api: Any) -> None:
        # `api`: the worker's `sim.entrypoints.server.SimApi` (its chat job runner; named as Any,
        # since the server imports this module)
        self._api = api
        self._stored: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = OrderedDict()

    async def create(self, request: Request) -> Response:
        data = read_json_body(await request.body(), request.headers.get("content-type"))
        if not isinstance(data, dict):
            raise vllm_validation_error("The request body must be a JSON object")
        api = self._api
        api._check_model(data.get("model"))
        messages = self._messages(data)
        auto_tools = api.worker.config.enable_auto_tool_choice
        chat = validate_body(_chat_body(data, messages, auto_tools), ChatCompletionRequest)
        ids = api._chat_ids(chat)
        check_prompt_tokens(
            ids, max_model_len=api.max_model_len, max_token_id=api.tok.max_token_id, from_text=True
        )
        resp_id = data.get("request_id") or f"resp_{random_uuid()}"
        job = api._job(chat, request, [ids], resp_id)
        natural = chat.requested_max_tokens is None and not chat.ignore_eos
        for req in job.requests:
            req.eos_after = api.worker.natural_length(req.request_id) if natural else None
        plan = plan_reply(chat, resp_id)  # tool calls: tool_calls.py
        planned = attach(plan, api.tok, job.requests, job.decoders) if plan else []
        head = _response_head(data, resp_id, job.requests[0].max_tokens)
        if data.get("stream"):
            return _event_stream(self._events(job, head, data, messages, plan))
        await api._run(job)
        choice = job.reply.choices[0]
        text = planned[0].text if planned else api.tok.decode(choice.token_ids)
        output = whole_output(plan, text, choice.finish_reason)
        return JSONResponse(self._finished(job, head, data, messages, output))

    def _messages(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        previous = data.get("previous_response_id")
        stored = None
        if previous is not None:
            stored = self._stored.get(previous)
            if stored is None:
                raise ApiError(
                    404,
                    "invalid_request_error",
                    f"Response with id '{previous}' not found.",
                    "response_id",
                )
        try:
            return input_messages(data, (stored[0], output_texts(stored[1])) if stored else None)
        except ResponsesInputError as exc:
            raise vllm_validation_error(str(exc), parameter=exc.param) from None

    def _finished(
        self,
        job: Any,
        head: dict[str, Any],
        data: dict[str, Any],
        messages: list[Any],
        output: list[dict[str, Any]],
    ) -> dict[str, Any]:
        choice = job.reply.choices[0]
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        body = {
            **head,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "output": output,
            "status": status,
            "usage": responses_usage(
                len(choice.prompt_ids), choice.cached_tokens, len(choice.token_ids)
            ),
        }
        if data.get("store", True) is not False:
            self._stored[body["id"]] = (messages, body)
            while len(self._stored) > STORE_LIMIT:
                self._stored.popitem(last=False)
        return body

    async def _events(
        self,
        job: Any,
        head: dict[str, Any],
        data: dict[str, Any],
        messages: list[Any],
        plan: Plan | None,
    ) -> AsyncIterator[dict[str, Any]]:
        start = {**head, "output": [], "status": "in_progress", "usage": None}
        yield stream_event("response.created", response=start)
        yield stream_event("response.in_progress", response=start)
        stream = ResponsesStream(plan)
        async for _, _, delta in self._api._outputs(job):
            for event in stream.feed(delta):
                yield event
        for event in stream.close():
            yield event
        final = self._finished(job, head, data, messages, stream.items)
        yield stream_event("response.completed", response=final)


def _chat_body(
    data: dict[str, Any], messages: list[dict[str, Any]], auto_tools: bool
) -> dict[str, Any]:
    """The chat turn the request runs as; with `auto_tools` false (no tool-call parser) its
    tools are rendered but never called."""
    chat: dict[str, Any] = {k: data[k] for k in _PASSED_ON if data.get(k) is not None}
    chat["messages"] = messages
    try:
        tools, choice = chat_tools(data), chat_tool_choice(data)
    except ResponsesInputError as exc:
        raise vllm_validation_error(str(exc), parameter=exc.param) from None
    if tools:
        chat.update(tools=tools, tool_choice=choice if auto_tools else "none")
    chat["add_special_tokens"] = True  # vLLM's Responses route tokenises with them; chat's not
    if data.get("max_output_tokens") is not None:
        chat["max_tokens"] = data["max_output_tokens"]
    return chat


def _response_head(data: dict[str, Any], resp_id: str, max_tokens: int) -> dict[str, Any]:
    return {
        "id": resp_id,
        "created_at": int(time.time()),
        "incomplete_details": None,
        "instructions": data.get("instructions"),
        "metadata": data.get("metadata"),
        "model": data.get("model"),
        "object": "response",
        "output": [],
        "parallel_tool_calls": data.get("parallel_tool_calls", True),
        "temperature": data.get("temperature", 1.0),
        "tool_choice": (data.get("tool_choice") or "auto") if data.get("tools") else "none",
        "tools": data.get("tools") or [],
        "top_p": data.get("top_p", 1.0),
        "background": bool(data.get("background")),
        "max_output_tokens": max_tokens,
        "max_tool_calls": data.get("max_tool_calls"),
        "previous_response_id": data.get("previous_response_id"),
        "prompt": None,
        "reasoning": None,
        "service_tier": data.get("service_tier", "auto"),
        "status": "in_progress",
        "text": None,
        "top_logprobs": None,
        "truncation": data.get("truncation", "disabled"),
        "usage": None,
        "user": data.get("user"),
    }


def responses_usage(prompt: int, cached: int, output: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": cached,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt + output,
    }


def _event_stream(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def sse() -> AsyncIterator[str]:
        n = 0
        async for event in events:
            event["sequence_number"] = n
            n += 1
            data = json.dumps(event, separators=(",", ":"))
            yield f"event: {event['type']}\ndata: {data}\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream")
