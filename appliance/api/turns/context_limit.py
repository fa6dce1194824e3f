"""A prompt that does not fit the model's context, refused as each API refuses it: 400, in
that API's words, which agent harnesses watch for to compact their context (and do not on
a 413).

The OpenAI routes (chat, completions, responses) answer as vLLM 0.32 does
(vllm/renderers/params.py; `type` BadRequestError), with OpenAI's own code for it,
`context_length_exceeded`, and refuse what it refuses: a prompt that leaves no room for one
output token. A prompt that fits while the answer it asks for does not is served, its
`max_tokens` shortened to what fits, as vLLM 0.32 does (`get_max_tokens` in
vllm/entrypoints/serve/utils/api_utils.py; the worker shortens it): clients such as
kv-cache-tester ask for long answers near the window. The Messages route counts the answer
too and refuses, as Anthropic's API does (`in_anthropic_words`): Claude Code reads that
message to lower its `max_tokens` and retry. A prompt that alone leaves no room for one
output token is a `PromptOverflow` as well (`ContextOverflow`, `OverflowRefused`): its harness
must compact, and the idle reaper drops the session's KV past its system prompt and tools.
"""

from __future__ import annotations

from appliance.api.errors import RequestRefused
from appliance.domain.errors import PromptOverflow

CODE = "context_length_exceeded"


class ContextTooLong(RequestRefused):
    """The prompt's `prompt_tokens` and the `max_tokens` it asks for (None: not given, one
    counted) exceed the model's `limit`."""

    def __init__(self, prompt_tokens: int, max_tokens: int | None, limit: int) -> None:
        self.prompt_tokens, self.max_tokens, self.limit = prompt_tokens, max_tokens, limit
        message, param = _vllm_words(prompt_tokens, max_tokens or 1, limit)
        super().__init__(400, message, CODE, param=param, kind="BadRequestError")

    def shifted(self, tokens: int) -> ContextTooLong:
        """The same refusal with `tokens` more in both the prompt and the limit: tokens a
        route puts before the prompt it had checked against the limit less them."""
        return too_long(self.prompt_tokens + tokens, self.max_tokens, self.limit + tokens)

    def in_anthropic_words(self) -> RequestRefused:
        """The refusal as Anthropic's Messages API words it (`invalid_request_error`)."""
        prompt, limit = self.prompt_tokens, self.limit
        refused = OverflowRefused if isinstance(self, PromptOverflow) else RequestRefused
        if prompt > limit:
            return refused(400, f"prompt is too long: {prompt} tokens > {limit} maximum", CODE)
        asked = self.max_tokens or 1
        return refused(
            400,
            f"input length and `max_tokens` exceed context limit: {prompt} + {asked} > {limit}, "
            "decrease input length or `max_tokens` and try again",
            CODE,
        )


def check_context(
    prompt_tokens: int, max_tokens: int | None, limit: int, *, answer_counts: bool = False
) -> None:
    """Raises ContextTooLong when the prompt and one output token exceed `limit` (vLLM
    0.32's rule), or with `answer_counts` the prompt and the `max_tokens` it asks for
    (Anthropic's)."""
    asked = max_tokens if answer_counts else None
    if prompt_tokens + (asked or 1) > limit:
        raise too_long(prompt_tokens, asked, limit)


class ContextOverflow(ContextTooLong, PromptOverflow):
    """A ContextTooLong whose prompt alone leaves no room for one output token."""


class OverflowRefused(RequestRefused, PromptOverflow):
    """A ContextOverflow in Anthropic's words."""


def too_long(prompt_tokens: int, max_tokens: int | None, limit: int) -> ContextTooLong:
    """The refusal: a ContextOverflow where the prompt alone does not fit with one token."""
    cls = ContextOverflow if prompt_tokens + 1 > limit else ContextTooLong
    return cls(prompt_tokens, max_tokens, limit)


def _vllm_words(prompt: int, asked: int, limit: int) -> tuple[str, str | None]:
    """vLLM's message and `param`; its messages end in what its exception's str() adds."""
    if prompt > limit:
        return (
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {prompt} input tokens, which exceeds this limit even without any output "
            f"tokens. Please reduce the length of the input prompt. (parameter=input_tokens, "
            f"value={prompt})",
            "input_tokens",
        )
    return (
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt + asked} tokens ({prompt} in the messages, {asked} in the completion). "
        "Please reduce the length of the messages or completion.",
        None,
    )
