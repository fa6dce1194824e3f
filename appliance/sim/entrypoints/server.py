"""The HTTP face of a simulated worker: vLLM 0.32's routes and JSON shapes (Starlette).

Model of the world (vLLM `entrypoints/openai/{completion,chat_completion}/serving.py`,
`serve/tokenize/`, `serve/instrumentator/`): a generation request is validated
(`protocol.py`), rendered to token ids (`tokenizer.py`), split into engine requests (one per
prompt and choice) and answered from the engine's outputs, either as one JSON body or as
Server-Sent Events ending in `data: [DONE]` (`responses.py` writes both as vLLM does). An
`ApiError` (`api_errors.py`) becomes vLLM's error body and status. A client that hangs up
aborts its requests: a stream's when the next event cannot be sent, one answered as a whole
body at once (vLLM's `with_cancellation`: the handler races the client's disconnect).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from appliance.domain.worker import WORKER_KEEPALIVE_S
from appliance.sim.engine_io import SimRequest
from appliance.sim.entrypoints.api_errors import ApiError, bad_request, model_not_found
from appliance.sim.entrypoints.detokenizer import IncrementalDecoder
from appliance.sim.entrypoints.dev_routes import dev_routes
from appliance.sim.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    base_request_id,
    check_prompt_tokens,
    effective_max_tokens,
    parse_request,
    read_json_body,
    session_id_of,
    tool_choice_error,
    validate_body,
)
from appliance.sim.entrypoints.responses import (
    GenerationReply,
    Outputs,
    ReplyChoice,
    ReplyWriter,
    model_list,
)
from appliance.sim.entrypoints.responses_api import ResponsesApi
from appliance.sim.entrypoints.tool_calls import attach, plan_reply
from appliance.sim.entrypoints.tool_replies import rewrite_body, rewrite_stream
from appliance.tokenization.chat_template import ChatTemplateError

if TYPE_CHECKING:
    from appliance.sim.runtime.worker import SimWorker

METRICS_CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"


@dataclass(slots=True)
class _Job:
    """A validated generation request, ready for the engine: its engine requests, a text
    decoder for each choice, and the reply it builds."""

    requests: list[SimRequest]
    decoders: list[IncrementalDecoder]
    reply: GenerationReply
    stream: bool


class SimApi:
    """Route handlers bound to one worker."""

    def __init__(self, worker: SimWorker) -> None:
        self.worker = worker
        self.tok = worker.tokenizer
        cfg = worker.config
        self.model_name = cfg.served_model_name
        self.max_model_len = cfg.max_model_len
        self.fingerprint = worker.system_fingerprint
        self.writer = ReplyWriter(
            self.model_name,
            self.fingerprint,
            cfg.block_size,
            lambda ids: self.tok.decode(ids, skip_special_tokens=True),
        )

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

    async def models(self, request: Request) -> Response:
        root = self.worker.config.model or self.model_name
        return JSONResponse(model_list(self.model_name, root, self.max_model_len))

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
        plan = plan_reply(body, job.reply.response_id)  # response_format: tool_calls.py
        planned = attach(plan, self.tok, job.requests, job.decoders) if plan else []
        if job.stream:
            return _sse(self.writer.completion_stream(job.reply, self._outputs(job)))
        if not await _unless_disconnected(request, self._run(job)):
            return Response(status_code=499)  # nobody reads it: the client is gone
        answer = self.writer.completion_body(job.reply)
        for choice in answer["choices"] if plan else ():
            choice["text"] = planned[choice["index"]].text
        return JSONResponse(answer)

    async def chat_completions(self, request: Request) -> Response:
        body = parse_request(
            await request.body(), request.headers.get("content-type"), ChatCompletionRequest
        )
        self._check_model(body.model)
        auto = self.worker.config.enable_auto_tool_choice
        if error := tool_choice_error(body.tool_choice, auto_tools_enabled=auto):
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
        plan = plan_reply(body, job.reply.response_id)  # tool calls, JSON: tool_calls.py
        planned = attach(plan, self.tok, job.requests, job.decoders) if plan else []
        if job.stream:
            chunks = self.writer.chat_stream(job.reply, self._outputs(job))
            return _sse(rewrite_stream(plan, chunks) if plan else chunks)
        if not await _unless_disconnected(request, self._run(job)):
            return Response(status_code=499)
        answer = self.writer.chat_body(job.reply)
        if plan:
            rewrite_body(plan, answer, planned)
        return JSONResponse(answer)

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
        choices: list[ReplyChoice] = []
        decoders: list[IncrementalDecoder] = []
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
                choices.append(ReplyChoice(len(choices), ids))
                decoders.append(IncrementalDecoder(self.tok))
        opts = body.stream_options
        include_usage = bool(body.stream and opts and opts.include_usage)
        reply = GenerationReply(
            response_id=response_id,
            created=int(time.time()),
            choices=choices,
            prompts=prompts,
            n=n,
            include_usage=include_usage,
            continuous_usage=include_usage and bool(opts and opts.continuous_usage_stats),
            return_token_ids=bool(body.return_token_ids),
        )
        return _Job(requests=reqs, decoders=decoders, reply=reply, stream=bool(body.stream))

    async def _outputs(self, job: _Job) -> Outputs:
        """(choice, new token ids, text delta) as the engine produces them."""
        async for i, out in self.worker.generate(job.requests, n_param=job.reply.n):
            choice = job.reply.choices[i]
            if out.first_token or not choice.token_ids:
                choice.cached_tokens = out.num_cached_tokens
            choice.token_ids += out.new_token_ids
            delta = job.decoders[i].push(out.new_token_ids)
            if out.finished:
                choice.finish_reason = out.finish_reason
            yield choice, out.new_token_ids, delta

    async def _run(self, job: _Job) -> None:
        async for _ in self._outputs(job):
            pass


async def _unless_disconnected(request: Request, work: Awaitable[None]) -> bool:
    """Runs `work` unless the client hangs up first (then it is cancelled, which aborts its
    engine requests): whether it ran to its end. vLLM's `with_cancellation`."""
    running = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((running, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not running.done():
            running.cancel()  # leaving `generate` early aborts its engine requests
    if not running.done():
        return False
    running.result()  # its errors are the handler's
    return True


async def _disconnect(request: Request) -> None:
    """Returns once the client has hung up (the body is read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
        ("/v1/responses", ResponsesApi(api).create, ["POST"]),
    )
    if worker.config.dev_mode:
        routes = (*routes, *dev_routes(worker))
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
