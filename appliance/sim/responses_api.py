"""vLLM 0.32's `POST /v1/responses` (the OpenAI Responses API), for the simulated worker.

Model of the world (vLLM `entrypoints/openai/responses/`, without Harmony and built-in
tools): the request becomes chat messages (`construct_input_messages`: the instructions as
a system message, then with `previous_response_id` the stored response's own messages less
their system ones and its output text as assistant messages, then the input: a string is
one user message, a list of items each a message) and runs as a chat turn on the same
engine path (template, prefix cache, scheduling). The answer is a `response` object whose
`output` holds one assistant message and whose `usage` counts `input_tokens` (with
`input_tokens_details.cached_tokens`) and `output_tokens`; streamed, the same as SSE events
`event: <type>` / `data: {...}` (`response.created`, `response.in_progress`, the message's
item and part, `response.output_text.delta` per piece, their `done` events, then
`response.completed` carrying the whole response), numbered by `sequence_number`, with no
`[DONE]`. With `store` (vLLM's default, under `VLLM_ENABLE_RESPONSES_API_STORE=1`) a
response and its messages stay in this worker's memory under its id `resp_...`, the oldest
dropped past `STORE_LIMIT`; an unknown `previous_response_id` is a 404
`invalid_request_error` with `param: "response_id"`. A restarted worker knows none.
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
from appliance.sim.api_errors import ApiError, vllm_validation_error
from appliance.sim.protocol import (
    ChatCompletionRequest,
    check_prompt_tokens,
    random_uuid,
    read_json_body,
    validate_body,
)

STORE_LIMIT = 10_000
_PASSED_ON = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "cache_salt",
    "priority", "session_id", "request_id", "vllm_xargs",
)  # fmt: skip
"""Fields that mean the same to the chat turn a Responses request runs as."""


class ResponsesApi:
    """`POST /v1/responses` on one simulated worker, and its store of responses."""

    def __init__(self, api: Any) -> None:
        # `api`: the worker's `sim.server.SimApi` (its chat job runner; named as Any, since
        # the server imports this module)
        self._api = api
        self._stored: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = OrderedDict()

    async def create(self, request: Request) -> Response:
        data = read_json_body(await request.body(), request.headers.get("content-type"))
        if not isinstance(data, dict):
            raise vllm_validation_error("The request body must be a JSON object")
        api = self._api
        api._check_model(data.get("model"))
        messages = self._messages(data)
        chat = validate_body(_chat_body(data, messages), ChatCompletionRequest)
        ids = api._chat_ids(chat)
        check_prompt_tokens(
            ids, max_model_len=api.max_model_len, max_token_id=api.tok.max_token_id, from_text=True
        )
        resp_id = data.get("request_id") or f"resp_{random_uuid()}"
        job = api._job(chat, request, [ids], resp_id)
        natural = chat.requested_max_tokens is None and not chat.ignore_eos
        for req in job.requests:
            req.eos_after = api.worker.natural_length(req.request_id) if natural else None
        head = _response_head(data, resp_id, job.requests[0].max_tokens)
        if data.get("stream"):
            return _event_stream(self._events(job, head, data, messages))
        await api._run(job)
        body = self._finished(job, head, data, messages)
        return JSONResponse(body)

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
        self, job: Any, head: dict[str, Any], data: dict[str, Any], messages: list[Any]
    ) -> dict[str, Any]:
        choice = job.reply.choices[0]
        text = self._api.tok.decode(choice.token_ids)
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        body = {
            **head,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "output": [output_message(f"msg_{random_uuid()}", text)],
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
        self, job: Any, head: dict[str, Any], data: dict[str, Any], messages: list[Any]
    ) -> AsyncIterator[dict[str, Any]]:
        start = {**head, "output": [], "status": "in_progress", "usage": None}
        yield {"type": "response.created", "response": start}
        yield {"type": "response.in_progress", "response": start}
        item_id, pieces = f"msg_{random_uuid()}", []
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        async for _, _, delta in self._api._outputs(job):
            if not delta:
                continue
            if not pieces:
                item = {**output_message(item_id, ""), "content": [], "status": "in_progress"}
                yield {"type": "response.output_item.added", "output_index": 0, "item": item}
                yield {"type": "response.content_part.added", **where, "part": _text_part("")}
            pieces.append(delta)
            yield {"type": "response.output_text.delta", **where, "delta": delta, "logprobs": []}
        text = "".join(pieces)
        yield {"type": "response.output_text.done", **where, "text": text, "logprobs": []}
        yield {"type": "response.content_part.done", **where, "part": _text_part(text)}
        item = output_message(item_id, text)
        yield {"type": "response.output_item.done", "output_index": 0, "item": item}
        final = self._finished(job, head, data, messages)
        final["output"] = [item]
        yield {"type": "response.completed", "response": final}


def _chat_body(data: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    chat: dict[str, Any] = {k: data[k] for k in _PASSED_ON if data.get(k) is not None}
    chat["messages"] = messages
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
        "tool_choice": data.get("tool_choice", "auto"),
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


def output_message(item_id: str, text: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "content": [_text_part(text)],
        "role": "assistant",
        "status": "completed",
        "type": "message",
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": None}


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
            kind = event["type"]
            body = {"type": kind, "sequence_number": n, **event}
            n += 1
            yield f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream")
