"""vLLM 0.32's response bodies and stream chunks, for the simulated worker.

Model of the world (vLLM `entrypoints/openai/{completion,chat_completion}/serving.py`):
responses are plain dicts built in vLLM's field order (pydantic's `model_dump` order), with
every field vLLM serialises, null where the sim has nothing to say (logprobs,
kv_transfer_params without a KV connector). Usage counts prompt tokens once per prompt and
reports `prompt_tokens_details.cached_tokens` (the prefix-cache hit at first scheduling),
as with `--enable-prompt-tokens-details`. Streams follow vLLM's serialisation: chunks drop
unset fields, the role chunk opens a chat stream, `system_fingerprint` rides on the
finishing chunk unless a usage chunk follows, continuous usage adds `usage` to every chunk.
`ReplyWriter` renders a `GenerationReply` (what the engine produced so far for one request)
as a whole body or as its stream's chunks.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from appliance.sim.entrypoints.protocol import random_uuid


@dataclass(slots=True)
class ReplyChoice:
    """One engine request's progress, as a response choice."""

    index: int
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0


@dataclass(slots=True)
class GenerationReply:
    """What a response to one generation request says, and how it is delivered."""

    response_id: str
    created: int
    choices: list[ReplyChoice]
    prompts: list[list[int]]
    n: int
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool


Outputs = AsyncIterator[tuple[ReplyChoice, list[int], str]]
"""(choice, new token ids, text delta) as the engine produces them."""


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def usage_info(
    prompt_tokens: int, completion_tokens: int, details: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`UsageInfo`; `details` adds prompt_tokens_details (the final usage)."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if details is not None:
        usage["prompt_tokens_details"] = details
        usage["completion_tokens_details"] = None
    return usage


def prompt_details(cached_tokens: int, created_cache_tokens: int | None) -> dict[str, Any]:
    return {
        "cached_tokens": cached_tokens,
        "created_cache_tokens": created_cache_tokens,
        "multimodal_tokens": None,
    }


def completion_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    token_ids: list[int] | None,
    prompt_token_ids: list[int] | None,
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "token_ids": token_ids,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_token_ids,
        "routed_experts": None,
    }


def chat_choice(
    index: int, content: str, finish_reason: str | None, token_ids: list[int] | None
) -> dict[str, Any]:
    message = {"role": "assistant", "content": content, "refusal": None, "annotations": None}
    message.update(audio=None, function_call=None, reasoning=None)
    return {
        "index": index,
        "message": message,
        "logprobs": None,
        "finish_reason": finish_reason or "stop",
        "stop_reason": None,
        "token_ids": token_ids,
        "routed_experts": None,
    }


def response_body(
    head: dict[str, Any],
    choices: list[dict[str, Any]],
    usage: dict[str, Any],
    fingerprint: str,
    chat_fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) response; `head` is id, object, created, model;
    `chat_fields` the prompt fields chat responses add after `usage`."""
    body = {**head, "choices": choices, "service_tier": None, "system_fingerprint": fingerprint}
    body["usage"] = usage
    body.update(chat_fields or {})
    body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
    return body


def final_usage_chunk(
    head: dict[str, Any], usage: dict[str, Any], fingerprint: str
) -> dict[str, Any]:
    """The trailing usage chunk, serialised without nulls."""
    usage = {k: v for k, v in usage.items() if v is not None}
    details = usage.get("prompt_tokens_details")
    if details:
        usage["prompt_tokens_details"] = {k: v for k, v in details.items() if v is not None}
    return {**head, "choices": [], "usage": usage, "system_fingerprint": fingerprint}


def model_list(model_name: str, root: str, max_model_len: int) -> dict[str, Any]:
    created = int(time.time())
    permission = {
        "id": f"modelperm-{random_uuid()}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    card = {"id": model_name, "object": "model", "created": created, "owned_by": "vllm"}
    card.update(root=root, parent=None, max_model_len=max_model_len, permission=[permission])
    return {"object": "list", "data": [card]}


class ReplyWriter:
    """One worker's bodies and chunks: its model name, fingerprint and block size, and
    `decode(token_ids)`, the text of generated tokens (special tokens skipped)."""

    def __init__(
        self,
        model_name: str,
        fingerprint: str,
        block_size: int,
        decode: Callable[[list[int]], str],
    ) -> None:
        self.model_name = model_name
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.decode = decode

    def _usage(self, r: GenerationReply, *, chat: bool) -> dict[str, Any]:
        """Final usage: prompt tokens once per prompt; cached tokens of the last prompt
        (completions) or the first choice (chat)."""
        completion = sum(len(c.token_ids) for c in r.choices)
        last = r.choices[0] if chat else r.choices[-1]
        created = None
        if chat:
            bs = self.block_size
            created = max(len(last.prompt_ids) // bs * bs - last.cached_tokens, 0)
        details = prompt_details(last.cached_tokens, created)
        return usage_info(sum(len(p) for p in r.prompts), completion, details)

    def _choice_usage(self, r: GenerationReply, c: ReplyChoice) -> dict[str, Any]:
        return usage_info(len(r.prompts[c.index // r.n]), len(c.token_ids))

    def _head(self, r: GenerationReply, obj: str) -> dict[str, Any]:
        return {
            "id": r.response_id,
            "object": obj,
            "created": r.created,
            "model": self.model_name,
        }

    def completion_body(self, r: GenerationReply) -> dict[str, Any]:
        rti = r.return_token_ids
        choices = [
            completion_choice(
                c.index,
                self.decode(c.token_ids),
                c.finish_reason,
                c.token_ids if rti else None,
                c.prompt_ids if rti else None,
            )
            for c in r.choices
        ]
        usage = self._usage(r, chat=False)
        return response_body(self._head(r, "text_completion"), choices, usage, self.fingerprint)

    async def completion_stream(self, r: GenerationReply, outputs: Outputs) -> AsyncIterator[str]:
        head = self._head(r, "text_completion")
        rti = r.return_token_ids
        started: set[int] = set()
        async for c, new_ids, delta in outputs:
            first = c.index not in started
            started.add(c.index)
            choice = {"index": c.index, "text": delta, "logprobs": None}
            choice.update(finish_reason=c.finish_reason, stop_reason=None)
            choice["prompt_token_ids"] = c.prompt_ids if rti and first else None
            choice["token_ids"] = new_ids if rti else None
            chunk: dict[str, Any] = {**head, "choices": [choice]}
            if r.continuous_usage:
                chunk["usage"] = self._choice_usage(r, c)
            if c.finish_reason is not None and not r.include_usage:
                chunk["system_fingerprint"] = self.fingerprint
            yield _dumps(chunk)
        if r.include_usage:
            yield _dumps(final_usage_chunk(head, self._usage(r, chat=False), self.fingerprint))

    def chat_body(self, r: GenerationReply) -> dict[str, Any]:
        rti = r.return_token_ids
        choices = [
            chat_choice(
                c.index,
                self.decode(c.token_ids),
                c.finish_reason,
                c.token_ids if rti else None,
            )
            for c in r.choices
        ]
        usage = self._usage(r, chat=True)
        prompt = {"prompt_logprobs": None, "prompt_token_ids": r.prompts[0] if rti else None}
        prompt["prompt_text"] = None
        head = self._head(r, "chat.completion")
        return response_body(head, choices, usage, self.fingerprint, prompt)

    async def chat_stream(self, r: GenerationReply, outputs: Outputs) -> AsyncIterator[str]:
        head = self._head(r, "chat.completion.chunk")
        started = False
        async for c, new_ids, delta in outputs:
            if not started:  # the role chunk of every choice comes with the first output
                started = True
                for chunk in self._role_chunks(r, head):
                    yield _dumps(chunk)
            choice: dict[str, Any] = {"index": c.index, "delta": {"content": delta}}
            choice.update(logprobs=None, finish_reason=c.finish_reason)
            if c.finish_reason is not None:
                choice["stop_reason"] = None
            choice["token_ids"] = new_ids if r.return_token_ids else None
            chunk = {**head, "choices": [choice]}
            if r.continuous_usage:
                chunk["usage"] = {**self._choice_usage(r, c), "completion_tokens_details": None}
            if c.finish_reason is not None and not r.include_usage:
                chunk["system_fingerprint"] = self.fingerprint
            yield _dumps(chunk)
        if r.include_usage:
            yield _dumps(final_usage_chunk(head, self._usage(r, chat=True), self.fingerprint))

    @staticmethod
    def _role_chunks(r: GenerationReply, head: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunk that opens each choice of a chat stream."""
        chunks = []
        for i in range(len(r.choices)):
            delta0 = {"role": "assistant", "content": ""}
            choice0 = {"index": i, "delta": delta0, "logprobs": None, "finish_reason": None}
            chunk: dict[str, Any] = {**head, "choices": [choice0]}
            if r.continuous_usage:
                chunk["usage"] = usage_info(len(r.prompts[0]), 0)
                chunk["usage"]["completion_tokens_details"] = None
            chunk["prompt_token_ids"] = r.prompts[0] if r.return_token_ids else None
            chunk["prompt_text"] = None
            chunks.append(chunk)
        return chunks
