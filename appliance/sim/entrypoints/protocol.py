"""Requests of vLLM 0.32's OpenAI-compatible server, for the simulated worker: reading,
validating and checking them.

Model of the world (vLLM `entrypoints/openai/*/protocol.py`): a body is read as JSON, the
content type must be `application/json`, and the body is validated by a pydantic model
whose fields have vLLM's types, so the same inputs fail with the same pydantic errors
(`api_errors.py` renders them as vLLM does). Checks run in vLLM's order: JSON, content
type, "before" validators (cache_salt, prompt presence, stream_options), field types,
model name, then rendering (empty prompt, out-of-vocabulary id, prompt longer than
max_model_len) and finally max_tokens, which is clamped to what the context has left and
must end up >= 1.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from appliance.sim.entrypoints.api_errors import (
    ApiError,
    bad_request,
    request_validation_error,
    vllm_validation_error,
)

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def random_uuid() -> str:
    """vLLM's request id: 16 hex digits."""
    return f"{uuid.uuid4().int & (2**64 - 1):016x}"


# --- request models: vLLM's field types, so the same bodies fail the same way ---


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


TokenId = Annotated[int, Field(ge=0)]
Prompt = list[TokenId] | list[list[TokenId]] | str | list[str] | None
StopParam = str | list[str] | None


class _GenerateRequest(_Request):
    """Fields common to completions and chat completions (vLLM's types)."""

    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: StopParam = []
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = []
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=_INT64_MIN, le=_INT64_MAX)
    request_id: str = Field(default_factory=random_uuid)
    session_id: str | None = None
    return_token_ids: bool | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=_INT64_MAX)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_before(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        salt = data.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise vllm_validation_error(
                "Parameter 'cache_salt' must be a non-empty string if provided.",
                parameter="cache_salt",
            )
        if isinstance(salt, str) and (len(salt) > 128 or any(c in "@/\\\x00" for c in salt)):
            raise vllm_validation_error(
                "Parameter 'cache_salt' must be at most 128 characters and must not contain "
                "'@', '/', '\\\\', or NUL.",
                parameter="cache_salt",
            )
        if data.get("stream_options") and not data.get("stream"):
            raise vllm_validation_error(
                "Stream options can only be defined when `stream=True`.",
                parameter="stream_options",
            )
        return data


class CompletionRequest(_GenerateRequest):
    prompt: Prompt = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _check_prompt(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("max_tokens") is None:
            data = {**data, "max_tokens": 16}
        prompt = data.get("prompt")
        if (prompt is None or prompt == "") and not data.get("prompt_embeds"):
            raise vllm_validation_error(
                "Either prompt or prompt_embeds must be provided and non-empty.",
                parameter="prompt",
            )
        return data


class ChatCompletionRequest(_GenerateRequest):
    messages: list[dict[str, Any]]
    logprobs: bool | None = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = None

    tool_choice: str | dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_chat_before(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("continue_final_message") and data.get("add_generation_prompt"):
            raise vllm_validation_error(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        return _check_tool_usage(data)

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


def _check_tool_usage(data: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `check_tool_usage`: tools present means tool_choice "auto" by default."""
    if data.get("tools") == []:
        raise vllm_validation_error(
            "`tools` must not be an empty array. Either provide at least one tool or omit "
            "the field entirely.",
            parameter="tools",
        )
    if "tool_choice" not in data and data.get("tools"):
        data = {**data, "tool_choice": "auto"}
    choice = data.get("tool_choice")
    if choice is None or choice == "none":
        return data
    if data.get("tools") is None:
        raise vllm_validation_error(
            "When using `tool_choice`, `tools` must be set.", parameter="tool_choice"
        )
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise vllm_validation_error(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", '
            '"auto" or "required" are supported.',
            parameter="tool_choice",
        )
    return data


def tool_choice_error(tool_choice: Any, *, auto_tools_enabled: bool) -> ApiError | None:
    """The 400 vLLM gives for a tool_choice it cannot honour without a tool-call parser
    (the sim's `enable_auto_tool_choice` stands for both flags)."""
    if tool_choice in (None, "none") or auto_tools_enabled:
        return None
    if tool_choice == "auto":
        return bad_request(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        )
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        desc = f'function "{name}"'
    else:
        desc = f'"{tool_choice}"'
    return bad_request(f"tool_choice={desc} requires --tool-call-parser to be set")


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=_INT64_MAX)]]


M = TypeVar("M", bound=BaseModel)


def read_json_body(raw: bytes, content_type: str | None) -> Any:
    """The decoded body, or the 400 vLLM gives for bad JSON / a non-JSON content type."""
    if raw.strip():
        try:
            data = json.loads(raw)
        except ValueError as exc:
            pos = getattr(exc, "pos", 0)
            msg = getattr(exc, "msg", str(exc))
            raise request_validation_error(
                [
                    {
                        "type": "json_invalid",
                        "loc": ("body", pos),
                        "msg": "JSON decode error",
                        "input": {},
                        "ctx": {"error": msg},
                    }
                ]
            ) from None
    else:
        data = None
    media_type = (content_type or "").lower().split(";", 1)[0].strip()
    if media_type != "application/json":
        raise request_validation_error(
            ["Unsupported Media Type: Only 'application/json' is allowed"]
        )
    return data


def validate_body(data: Any, *models: type[M]) -> M:
    """Validate against the first model that accepts the body (vLLM's union of request
    forms); errors of every form when none does."""
    if data is None:
        raise request_validation_error(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        )
    if not isinstance(data, dict):
        raise request_validation_error(
            [
                {
                    "type": "model_attributes_type",
                    "loc": ("body",),
                    "msg": "Input should be a valid dictionary or object to extract fields from",
                    "input": data,
                }
            ]
        )
    errors: list[dict[str, Any]] = []
    for model in models:
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            for err in exc.errors(include_url=False):
                errors.append({**err, "loc": ("body", *err["loc"])})
    raise request_validation_error(errors)


def parse_request(raw: bytes, content_type: str | None, *models: type[M]) -> M:
    return validate_body(read_json_body(raw, content_type), *models)


# --- rendering checks that follow validation ---


def check_prompt_tokens(
    token_ids: Sequence[int], *, max_model_len: int, max_token_id: int, from_text: bool
) -> None:
    """vLLM's renderer checks on a prompt's token ids."""
    if not token_ids:
        raise bad_request("You must pass at least one prompt")
    if not from_text:
        low, high = min(token_ids), max(token_ids)
        if low < 0:
            raise vllm_validation_error(f"Token id {low} is out of vocabulary")
        if high > max_token_id:
            raise vllm_validation_error(f"Token id {high} is out of vocabulary")
    if len(token_ids) > max_model_len:
        # A text prompt is tokenised with truncation to max_model_len + 1 tokens.
        count = max_model_len + 1 if from_text else len(token_ids)
        qualifier = "at least " if count == max_model_len + 1 else ""
        raise vllm_validation_error(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {qualifier}{count} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            parameter="input_tokens",
            value=count,
        )


def effective_max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    """`get_max_tokens` then SamplingParams' check: the request's max_tokens capped at
    what the context leaves; below 1 is an error."""
    left = max_model_len - prompt_len
    value = left if requested is None else min(requested, left)
    if value < 1:
        raise vllm_validation_error(
            f"max_tokens must be at least 1, got {value}.", parameter="max_tokens", value=value
        )
    return value


def session_id_of(body: _GenerateRequest, headers: Mapping[str, str]) -> str | None:
    """vLLM's precedence: body, then the X-Session-ID header, then vllm_xargs.session_id."""
    if body.session_id:
        return body.session_id
    if header := headers.get("x-session-id"):
        return header
    xarg = (body.vllm_xargs or {}).get("session_id")
    return str(xarg) if xarg is not None else None


def base_request_id(body: _GenerateRequest, headers: Mapping[str, str]) -> str:
    """The X-Request-Id header overrides the body's request_id."""
    return headers.get("x-request-id") or body.request_id
