"""The HTTP face of a simulated worker: vLLM 0.32's routes and JSON shapes (Starlette).

Model of the world (vLLM `entrypoints/openai/{completion,chat_completion}/serving.py`,
`serve/tokenize/`, `serve/instrumentator/`): a generation request is validated
(`protocol.py`), rendered to token ids (`tokenizer.py`), split into engine requests (one per
prompt and choice) and answered from the engine's outputs, either as one JSON body or as
Server-Sent Events ending in `data: [DONE]`. Responses carry every field vLLM serialises,
in its order, null where the sim has nothing (logprobs, kv_transfer_params without a KV
connector). Usage counts prompt tokens once per prompt and reports
`prompt_tokens_details.cached_tokens` (the prefix-cache hit at first scheduling), as with
`--enable-prompt-tokens-details`. Streams follow vLLM's serialisation: chunks drop unset
fields, the role chunk opens a chat stream, `system_fingerprint` rides on the finishing
chunk unless a usage chunk follows, continuous usage adds `usage` to every chunk.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from appliance.domain.worker import WORKER_KEEPALIVE_S
from appliance.sim import protocol as P
from appliance.sim.engine_io import SimRequest
from appliance.sim.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    bad_request,
    base_request_id,
    check_prompt_tokens,
    effective_max_tokens,
    model_not_found,
    parse_request,
    read_json_body,
    session_id_of,
    validate_body,
)
from appliance.sim.tokenizer import ChatTemplateError, IncrementalDecoder

if TYPE_CHECKING:
    from appliance.sim.worker import SimWorker

METRICS_CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


@dataclass(slots=True)
class _Choice:
    """One engine request's progress, as a response choice."""

    index: int
    prompt_ids: list[int]
    decoder: IncrementalDecoder
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0


@dataclass(slots=True)
class _Job:
    """A validated generation request, ready for the engine."""

    response_id: str
    created: int
    requests: list[SimRequest]
    choices: list[_Choice]
    prompts: list[list[int]]
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool


class SimApi:
    """Route handlers bound to one worker."""

    def __init__(self, worker: SimWorker) -> None:
        self.worker = worker
        self.tok = worker.tokenizer
        cfg = worker.config
        self.model_name = cfg.served_model_name
        self.max_model_len = cfg.max_model_len
        self.fingerprint = worker.system_fingerprint

    # --- small routes ---

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.worker.healthy else 503)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": "0.32.0"})

    async def load(self, request: Request) -> Response:
        return JSONResponse({"server_load": 0})

    async def kv_event_sources(self, request: Request) -> Response:
        return JSONResponse(self.worker.kv_event_sources())

    async def metrics(self, request: Request) -> Response:
        return Response(self.worker.metrics_text(), media_type=METRICS_CONTENT_TYPE)

    async def reset_prefix_cache(self, request: Request) -> Response:
        return JSONResponse({"success": self.worker.reset_prefix_cache()})

    async def models(self, request: Request) -> Response:
        root = self.worker.config.model or self.model_name
        return JSONResponse(P.model_list(self.model_name, root, self.max_model_len))

    def _check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise model_not_found(model, [self.model_name])

    async def tokenize(self, request: Request) -> Response:
        data = read_json_body(await request.body(), request.headers.get("content-type"))
        forms: tuple[type[TokenizeChatRequest] | type[TokenizeCompletionRequest], ...] = (
            TokenizeCompletionRequest,
            TokenizeChatRequest,
        )
        if isinstance(data, dict) and "messages" in data:
            forms = forms[::-1]
        body = validate_body(data, *forms)
        self._check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            ids = self._chat_ids(body)
        else:
            ids = self.tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        strs = [self.tok.id_to_token(i) for i in ids] if body.return_token_strs else None
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": self.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        body = parse_request(
            await request.body(), request.headers.get("content-type"), DetokenizeRequest
        )
        self._check_model(body.model)
        return JSONResponse({"prompt": self.tok.decode(body.tokens)})

    def _chat_ids(self, body: ChatCompletionRequest | TokenizeChatRequest) -> list[int]:
        try:
            return self.tok.encode_chat(
                body.messages,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                template_kwargs=body.chat_template_kwargs,
                tools=body.tools,
                add_special_tokens=body.add_special_tokens,
            )
        except ChatTemplateError as exc:
            raise bad_request(str(exc)) from None

    # --- generation ---

    async def completions(self, request: Request) -> Response:
        body = parse_request(
            await request.body(), request.headers.get("content-type"), CompletionRequest
        )
        self._check_model(body.model)
        prompts = self._completion_prompts(body)
        job = self._job(body, request, prompts, f"cmpl-{base_request_id(body, request.headers)}")
        if job.stream:
            return _sse(self._completion_stream(job))
        await self._run(job)
        return JSONResponse(self._completion_body(job))

    async def chat_completions(self, request: Request) -> Response:
        body = parse_request(
            await request.body(), request.headers.get("content-type"), ChatCompletionRequest
        )
        self._check_model(body.model)
        auto = self.worker.config.enable_auto_tool_choice
        if error := P.tool_choice_error(body.tool_choice, auto_tools_enabled=auto):
            raise error
        ids = self._chat_ids(body)
        check_prompt_tokens(
            ids,
            max_model_len=self.max_model_len,
            max_token_id=self.tok.max_token_id,
            from_text=True,
        )
        job = self._job(body, request, [ids], f"chatcmpl-{base_request_id(body, request.headers)}")
        natural = body.requested_max_tokens is None and not body.ignore_eos
        for req in job.requests:
            req.eos_after = self.worker.natural_length(req.request_id) if natural else None
        if job.stream:
            return _sse(self._chat_stream(job))
        await self._run(job)
        return JSONResponse(self._chat_body(job))

    def _completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        raw = body.prompt
        items: list[Any] = [raw] if isinstance(raw, str) else list(raw or [])
        if items and all(isinstance(t, int) for t in items):
            items = [items]
        prompts: list[list[int]] = []
        for item in items:
            from_text = isinstance(item, str)
            ids = (
                self.tok.encode(item, add_special_tokens=body.add_special_tokens)
                if from_text
                else list(item)
            )
            check_prompt_tokens(
                ids,
                max_model_len=self.max_model_len,
                max_token_id=self.tok.max_token_id,
                from_text=from_text,
            )
            prompts.append(ids)
        if not prompts:
            raise bad_request("You must pass at least one prompt")
        return prompts

    def _job(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        request: Request,
        prompts: list[list[int]],
        response_id: str,
    ) -> _Job:
        requested = (
            body.requested_max_tokens
            if isinstance(body, ChatCompletionRequest)
            else body.max_tokens
        )
        limits = [effective_max_tokens(requested, len(p), self.max_model_len) for p in prompts]
        n = body.n or 1
        session_id = session_id_of(body, request.headers)
        reqs: list[SimRequest] = []
        choices: list[_Choice] = []
        for i, (ids, max_tokens) in enumerate(zip(prompts, limits, strict=True)):
            for _ in range(n):
                reqs.append(
                    SimRequest(
                        request_id=self.worker.new_request_id(f"{response_id}-{i}"),
                        prompt_token_ids=ids,
                        max_tokens=max_tokens,
                        ignore_eos=body.ignore_eos,
                        cache_salt=body.cache_salt,
                        session_id=session_id,
                        priority=body.priority,
                    )
                )
                choices.append(_Choice(len(choices), ids, IncrementalDecoder(self.tok)))
        opts = body.stream_options
        include_usage = bool(body.stream and opts and opts.include_usage)
        return _Job(
            response_id=response_id,
            created=int(time.time()),
            requests=reqs,
            choices=choices,
            prompts=prompts,
            n=n,
            stream=bool(body.stream),
            include_usage=include_usage,
            continuous_usage=include_usage and bool(opts and opts.continuous_usage_stats),
            return_token_ids=bool(body.return_token_ids),
        )

    async def _outputs(self, job: _Job) -> AsyncIterator[tuple[_Choice, list[int], str]]:
        """(choice, new token ids, text delta) as the engine produces them."""
        async for i, out in self.worker.generate(job.requests, n_param=job.n):
            choice = job.choices[i]
            if out.first_token or not choice.token_ids:
                choice.cached_tokens = out.num_cached_tokens
            choice.token_ids += out.new_token_ids
            delta = choice.decoder.push(out.new_token_ids)
            if out.finished:
                choice.finish_reason = out.finish_reason
            yield choice, out.new_token_ids, delta

    async def _run(self, job: _Job) -> None:
        async for _ in self._outputs(job):
            pass

    def _usage(self, job: _Job, *, chat: bool) -> dict[str, Any]:
        """Final usage: prompt tokens once per prompt; cached tokens of the last prompt
        (completions) or the first choice (chat)."""
        completion = sum(len(c.token_ids) for c in job.choices)
        last = job.choices[0] if chat else job.choices[-1]
        created = None
        if chat:
            bs = self.worker.config.block_size
            created = max(len(last.prompt_ids) // bs * bs - last.cached_tokens, 0)
        details = P.prompt_details(last.cached_tokens, created)
        return P.usage_info(sum(len(p) for p in job.prompts), completion, details)

    def _choice_usage(self, job: _Job, c: _Choice) -> dict[str, Any]:
        return P.usage_info(len(job.prompts[c.index // job.n]), len(c.token_ids))

    def _head(self, job: _Job, obj: str) -> dict[str, Any]:
        return {
            "id": job.response_id,
            "object": obj,
            "created": job.created,
            "model": self.model_name,
        }

    def _completion_body(self, job: _Job) -> dict[str, Any]:
        rti = job.return_token_ids
        choices = [
            P.completion_choice(
                c.index,
                self.tok.decode(c.token_ids, skip_special_tokens=True),
                c.finish_reason,
                c.token_ids if rti else None,
                c.prompt_ids if rti else None,
            )
            for c in job.choices
        ]
        usage = self._usage(job, chat=False)
        return P.response_body(self._head(job, "text_completion"), choices, usage, self.fingerprint)

    async def _completion_stream(self, job: _Job) -> AsyncIterator[str]:
        head = self._head(job, "text_completion")
        rti = job.return_token_ids
        started: set[int] = set()
        async for c, new_ids, delta in self._outputs(job):
            first = c.index not in started
            started.add(c.index)
            choice = {"index": c.index, "text": delta, "logprobs": None}
            choice.update(finish_reason=c.finish_reason, stop_reason=None)
            choice["prompt_token_ids"] = c.prompt_ids if rti and first else None
            choice["token_ids"] = new_ids if rti else None
            chunk: dict[str, Any] = {**head, "choices": [choice]}
            if job.continuous_usage:
                chunk["usage"] = self._choice_usage(job, c)
            if c.finish_reason is not None and not job.include_usage:
                chunk["system_fingerprint"] = self.fingerprint
            yield _dumps(chunk)
        if job.include_usage:
            yield _dumps(P.final_usage_chunk(head, self._usage(job, chat=False), self.fingerprint))

    def _chat_body(self, job: _Job) -> dict[str, Any]:
        rti = job.return_token_ids
        choices = [
            P.chat_choice(
                c.index,
                self.tok.decode(c.token_ids, skip_special_tokens=True),
                c.finish_reason,
                c.token_ids if rti else None,
            )
            for c in job.choices
        ]
        usage = self._usage(job, chat=True)
        prompt = {"prompt_logprobs": None, "prompt_token_ids": job.prompts[0] if rti else None}
        prompt["prompt_text"] = None
        head = self._head(job, "chat.completion")
        return P.response_body(head, choices, usage, self.fingerprint, prompt)

    async def _chat_stream(self, job: _Job) -> AsyncIterator[str]:
        head = self._head(job, "chat.completion.chunk")
        started = False
        async for c, new_ids, delta in self._outputs(job):
            if not started:  # the role chunk of every choice comes with the first output
                started = True
                for i in range(len(job.choices)):
                    delta0 = {"role": "assistant", "content": ""}
                    choice0 = {"index": i, "delta": delta0, "logprobs": None, "finish_reason": None}
                    chunk: dict[str, Any] = {**head, "choices": [choice0]}
                    if job.continuous_usage:
                        chunk["usage"] = P.usage_info(len(job.prompts[0]), 0)
                        chunk["usage"]["completion_tokens_details"] = None
                    chunk["prompt_token_ids"] = job.prompts[0] if job.return_token_ids else None
                    chunk["prompt_text"] = None
                    yield _dumps(chunk)
            choice: dict[str, Any] = {"index": c.index, "delta": {"content": delta}}
            choice.update(logprobs=None, finish_reason=c.finish_reason)
            if c.finish_reason is not None:
                choice["stop_reason"] = None
            choice["token_ids"] = new_ids if job.return_token_ids else None
            chunk = {**head, "choices": [choice]}
            if job.continuous_usage:
                chunk["usage"] = {**self._choice_usage(job, c), "completion_tokens_details": None}
            if c.finish_reason is not None and not job.include_usage:
                chunk["system_fingerprint"] = self.fingerprint
            yield _dumps(chunk)
        if job.include_usage:
            yield _dumps(P.final_usage_chunk(head, self._usage(job, chat=True), self.fingerprint))


def _sse(chunks: AsyncIterator[str]) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        async for chunk in chunks:
            yield f"data: {chunk}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


Handler = Callable[[Request], Awaitable[Response]]


def _guard(handler: Handler) -> Handler:
    """Turn an `ApiError` into vLLM's error body and status."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)

    return wrapped


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)


def create_app(worker: SimWorker) -> Starlette:
    """The ASGI app of one simulated worker (the worker's loop must be started separately)."""
    api = SimApi(worker)
    routes: Sequence[tuple[str, Handler, list[str]]] = (
        ("/health", api.health, ["GET"]),
        ("/version", api.version, ["GET"]),
        ("/load", api.load, ["GET"]),
        ("/kv_event_sources", api.kv_event_sources, ["GET"]),
        ("/metrics", api.metrics, ["GET"]),
        ("/v1/models", api.models, ["GET"]),
        ("/tokenize", api.tokenize, ["POST"]),
        ("/detokenize", api.detokenize, ["POST"]),
        ("/v1/completions", api.completions, ["POST"]),
        ("/v1/chat/completions", api.chat_completions, ["POST"]),
    )
    if worker.config.dev_mode:
        routes = (*routes, ("/reset_prefix_cache", api.reset_prefix_cache, ["POST"]))
    return Starlette(
        routes=[Route(path, _guard(h), methods=m) for path, h, m in routes],
        exception_handlers={HTTPException: _http_error},
    )


def make_server(app: Starlette, host: str, port: int) -> uvicorn.Server:
    """A uvicorn server for `app` (it handles SIGINT/SIGTERM when run in the main thread)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        lifespan="off",
        timeout_keep_alive=WORKER_KEEPALIVE_S,
    )
    return uvicorn.Server(config)
