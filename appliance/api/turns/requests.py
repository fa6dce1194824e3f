"""Reading one model request: its body, its agent headers and its prompt's token ids.

Everything a client can get wrong is checked here, before anything reaches a worker: the
body's size and JSON, the fields the appliance relies on (model, messages or prompt,
max_tokens, stream), the agent headers, and the prompt's length against the model's.
The body itself travels on unchanged, so vLLM's own extra fields pass through.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from appliance.api.errors import RequestRefused
from appliance.api.turns.context_limit import check_context
from appliance.services.sessions.chat_tokens import ChatEncoder, ChatTokens, with_stem

MAX_BODY_BYTES = 8 * 2**20
MAX_JSON_DEPTH = 100
"""Nesting a body may have: deeper would fail the worker body's serialisation (orjson's
limit is 254), and no OpenAI field nests that deep."""
MAX_ID_CHARS = 256
MAX_TOKEN_ID = 2**31 - 1
LIMITS = {
    "n": 16,
    "best_of": 16,
    "logprobs": 20,
    "top_logprobs": 20,
    "stop": 16,
    "stop_token_ids": 64,
    "tools": 128,
    "logit_bias": 300,
}
"""The most a request may ask for of each: every answer is generated per choice, and a
worker holds each choice's KV and logprobs until the answer is whole. Agents ask for one."""
"""Above any vocabulary; token ids are kept as 64-bit integers on the way to the worker."""


class Tokenizer(Protocol):
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(self, messages: Any, **kwargs: Any) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class AgentHeaders:
    session_id: str | None
    session_note: str | None
    """Where `session_id` came from, for the route decision ("session from X-Session-ID")."""
    task_id: str | None
    parent_task_id: str | None
    deadline_s: float | None
    priority: int | None
    tool_class: str | None
    expected_wait_s: float | None
    escalate: str | None = None  # X-Escalate: an outside endpoint's name, or `local`


def parse_json_body(raw: bytes) -> dict[str, Any]:
    if len(raw) > MAX_BODY_BYTES:
        raise RequestRefused(
            413,
            f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}",
            "body_too_large",
        )
    try:
        body = orjson.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestRefused(
            400, f"request body is not valid JSON: {exc}", "invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise RequestRefused(400, "request body must be a JSON object", "invalid_json")
    # A body cannot nest deeper than it has brackets: only a rare one is walked.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _depth(body) > MAX_JSON_DEPTH:
        raise RequestRefused(
            400, f"request body nests deeper than {MAX_JSON_DEPTH} levels", "invalid_json"
        )
    return body


def _depth(value: Any) -> int:
    """How deep a parsed JSON value nests, up to one past `MAX_JSON_DEPTH`. Iterative (a deep
    one must not overflow) and holding one iterator per level, not every value seen: a wide
    body (a million small objects) makes no list of them."""
    deepest, stack = 0, [iter((value,))]
    while stack:
        for item in stack[-1]:
            if isinstance(item, dict | list):
                deepest = max(deepest, len(stack))
                if len(stack) <= MAX_JSON_DEPTH:
                    stack.append(iter(item.values() if isinstance(item, dict) else item))
                    break
        else:
            stack.pop()
    return deepest


def identifier(value: Any, name: str) -> str:
    """A client's id (a session, a task): 1-256 printable characters, as the headers."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS or not value.isprintable():
        raise RequestRefused(
            400,
            f"'{name}' must be 1-{MAX_ID_CHARS} printable characters",
            "invalid_value",
            param=name,
        )
    return value


def _text_header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        return None
    value = value.strip()
    if not value or len(value) > MAX_ID_CHARS or not value.isprintable():
        raise RequestRefused(
            400, f"header {name} must be 1-{MAX_ID_CHARS} printable characters", "invalid_header"
        )
    return value


def _number_header(headers: Mapping[str, str], name: str, *, integer: bool = False) -> Any:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise RequestRefused(
            400, f"header {name} must be {kind}, not {raw!r}", "invalid_header"
        ) from None
    if not integer and (not math.isfinite(value) or value < 0):
        raise RequestRefused(400, f"header {name} must be a finite number >= 0", "invalid_header")
    return value


SESSION_HEADERS = (
    ("x-session-id", "X-Session-ID"),
    ("x-claude-code-session-id", "X-Claude-Code-Session-Id"),  # Claude Code 2.1.86+
    ("session_id", "session_id"),  # the Codex CLI's
    ("session-id", "session-id"),  # the Codex CLI's, newer
)
"""Headers that name a turn's session, in the order they are asked (the body's `session_id`
comes right after X-Session-ID, the body's `prompt_cache_key` after them all)."""


def client_session(headers: Mapping[str, str], body: Mapping[str, Any]) -> tuple[str, str] | None:
    """The session a turn names itself, and where it named it: X-Session-ID (or the body's
    `session_id`), else the harness's own session id (Claude Code's, the Codex CLI's
    headers), else the body's `prompt_cache_key` (a client's cache-routing key). Each is
    1-256 printable characters, else the turn is refused (400)."""
    for i, (name, shown) in enumerate(SESSION_HEADERS):
        value = _text_header(headers, name)
        if value is not None:
            return value, f"session from {shown}"
        if i == 0 and body.get("session_id") is not None:
            return identifier(body["session_id"], "session_id"), "session from body session_id"
    if body.get("prompt_cache_key") is not None:
        key = identifier(body["prompt_cache_key"], "prompt_cache_key")
        return key, "session from prompt_cache_key"
    return None


def agent_headers(headers: Mapping[str, str], body: Mapping[str, Any]) -> AgentHeaders:
    session, note = client_session(headers, body) or (None, None)
    task_id = _text_header(headers, "x-task-id")
    parent_task_id = _text_header(headers, "x-parent-task-id")
    if task_id is not None and task_id == parent_task_id:
        raise RequestRefused(
            400,
            "X-Parent-Task-ID names the task itself",
            "invalid_header",
            param="x-parent-task-id",
        )
    return AgentHeaders(
        session_id=session,
        session_note=note,
        task_id=task_id,
        parent_task_id=parent_task_id,
        deadline_s=_number_header(headers, "x-deadline-s"),
        priority=_number_header(headers, "x-priority", integer=True),
        tool_class=_text_header(headers, "x-tool-class"),
        expected_wait_s=_number_header(headers, "x-expected-tool-wait-s"),
        escalate=_text_header(headers, "x-escalate"),
    )


def _field(body: Mapping[str, Any], name: str, kind: type, what: str) -> Any:
    value = body.get(name)
    wrong = not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool)
    if value is not None and wrong:
        raise RequestRefused(400, f"'{name}' must be {what}", "invalid_type", param=name)
    return value


def prompt_tokens(
    path: str,
    body: dict[str, Any],
    tokenizer: Tokenizer,
    *,
    model: str,
    max_model_len: int,
    previous: ChatTokens | None = None,
    encoder: ChatEncoder | None = None,
) -> tuple[Sequence[int], ChatTokens | None]:
    """The prompt's token ids as vLLM will see them (raises RequestRefused for any bad field), and
    the rendered chat to keep for the session's next turn (None when the tokenizer cannot
    tokenise incrementally, or for a completion): a chat is tokenised only past what it
    shares with `previous`, the session's last turn, by `encoder` (give the same one every
    time: it remembers long pieces) or else a new `chat_encoder`."""
    max_tokens = check_model_request(path, body, model)
    return tokenize_checked(
        path,
        body,
        tokenizer,
        max_tokens=max_tokens,
        max_model_len=max_model_len,
        previous=previous,
        encoder=encoder,
    )


def tokenize_checked(
    path: str,
    body: dict[str, Any],
    tokenizer: Tokenizer,
    *,
    max_tokens: int | None,
    max_model_len: int,
    previous: ChatTokens | None = None,
    encoder: ChatEncoder | None = None,
    answer_counts: bool = False,
) -> tuple[Sequence[int], ChatTokens | None]:
    """`prompt_tokens` for a body `check_model_request` already passed (giving `max_tokens`);
    `answer_counts`: the answer it asks for must fit the window too (api/turns/context_limit.py)."""
    chat = None
    if path.endswith("chat/completions"):
        ids, chat = _chat_ids(body, tokenizer, previous, encoder or chat_encoder(tokenizer))
    else:
        ids = _completion_ids(body, tokenizer)
    check_context(len(ids), max_tokens, max_model_len, answer_counts=answer_counts)
    return ids, chat


def served_model(body: dict[str, Any], aliases: Mapping[str, str]) -> None:
    """Puts the served model in `body["model"]` when that names an alias of it (`*`: any
    name), so the worker, which knows only the served name, takes the request."""
    name = body.get("model")
    if isinstance(name, str) and aliases:
        body["model"] = aliases.get(name) or aliases.get("*") or name


def check_model_request(path: str, body: dict[str, Any], model: str) -> int | None:
    """Checks the fields every model request needs (and, for a chat, its messages); returns
    its `max_tokens` (None: not given). Raises RequestRefused for any bad field."""
    name = _field(body, "model", str, "a string")
    if name is None:
        raise RequestRefused(400, "'model' is required", "missing_field", param="model")
    if name != model:
        raise RequestRefused(
            404, f"The model `{name}` does not exist.", "model_not_found", param="model"
        )
    max_tokens: int | None = _field(body, "max_tokens", int, "an integer")
    if path.endswith("chat/completions"):
        max_tokens = _field(body, "max_completion_tokens", int, "an integer") or max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise RequestRefused(
            400, "'max_tokens' must be at least 1", "invalid_value", param="max_tokens"
        )
    _field(body, "stream", bool, "true or false")
    _field(body, "stream_options", dict, "an object")
    _check_limits(body)
    if path.endswith("chat/completions"):
        _check_messages(body)
    return max_tokens


def chat_encoder(tokenizer: Tokenizer) -> ChatEncoder | None:
    """An incremental encoder for a tokenizer that declares `split_before` (see
    `ModelTokenizer.split_before`) and renders chats itself; None for any other."""
    split_before = getattr(tokenizer, "split_before", ())
    if not split_before or not callable(getattr(tokenizer, "render_chat", None)):
        return None
    return ChatEncoder(lambda text: tokenizer.encode(text, add_special_tokens=False), split_before)


def _chat_ids(
    body: dict[str, Any],
    tokenizer: Tokenizer,
    previous: ChatTokens | None,
    encoder: ChatEncoder | None,
) -> tuple[Sequence[int], ChatTokens | None]:
    messages = body["messages"]  # checked by check_model_request
    kw: dict[str, Any] = {"add_generation_prompt": body.get("add_generation_prompt", True)}
    if isinstance(body.get("tools"), list) and body["tools"]:
        kw["tools"] = body["tools"]  # the template renders them into the prompt, as vLLM's
    try:
        if encoder is not None:
            render = tokenizer.render_chat  # type: ignore[attr-defined]
            chat = encoder(render(messages, **kw), previous)
            if previous is None:  # a session's first turn: what its agent's sessions share
                chat = _with_stem(chat, messages, kw, render)
            return chat.ids, chat  # the same array all the way to the session: no copies
        return tokenizer.encode_chat(messages, **kw), None
    except (ValueError, TypeError) as exc:
        raise RequestRefused(
            400, f"cannot render the messages: {exc}", "invalid_messages"
        ) from None


STEM_ROLES = frozenset({"system", "developer"})


def _with_stem(
    chat: ChatTokens, messages: list[Any], kw: dict[str, Any], render: Callable[..., str]
) -> ChatTokens:
    """`chat` with its stem: its leading system messages and tool schemas, rendered alone
    (a template that cannot render them alone gives no stem)."""
    n = next((i for i, m in enumerate(messages) if m.get("role") not in STEM_ROLES), len(messages))
    if n == 0 and "tools" not in kw:
        return chat
    try:
        stem_text = render(messages[:n], **{**kw, "add_generation_prompt": False})
    except (ValueError, TypeError, LookupError):
        return chat
    return with_stem(chat, stem_text)


def _check_limits(body: dict[str, Any]) -> None:
    """Every size the client sets, within `LIMITS`: a 400 naming the field and its limit."""
    for name, limit in LIMITS.items():
        value = body.get(name)
        if value is None or value is False or value is True:
            continue
        size = len(value) if isinstance(value, list | dict | str) else value
        if name == "stop" and isinstance(value, str):
            size = 1
        if not isinstance(size, int) or size < 0:
            raise RequestRefused(
                400, f"'{name}' must be a count or a list", "invalid_type", param=name
            )
        if size > limit:
            raise RequestRefused(
                400, f"'{name}' is {size}; the limit is {limit}", "limit_exceeded", param=name
            )


def _check_messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestRefused(
            400, "'messages' must be a non-empty list", "invalid_type", param="messages"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestRefused(
                400,
                f"messages[{i}] must be an object with a 'role' string",
                "invalid_type",
                param="messages",
            )
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise RequestRefused(
                400,
                f"messages[{i}].content must be a string or a list of parts",
                "invalid_type",
                param="messages",
            )


def _completion_ids(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=body.get("add_special_tokens", True))
    if (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID
            for t in prompt
        )
    ):
        return list(prompt)
    raise RequestRefused(
        400,
        f"'prompt' must be a string or a non-empty list of token ids (integers 0-{MAX_TOKEN_ID})",
        "invalid_type",
        param="prompt",
    )
