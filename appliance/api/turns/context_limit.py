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
message to lower its `max_tokens` and retry.
"""

from __future__ import annotations

from appliance.api.errors import RequestRefused

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
        return ContextTooLong(self.prompt_tokens + tokens, self.max_tokens, self.limit + tokens)

    def in_anthropic_words(self) -> RequestRefused:
        """The refusal as Anthropic's Messages API words it (`invalid_request_error`)."""
        prompt, limit = self.prompt_tokens, self.limit
        if prompt > limit:
            return RequestRefused(
                400, f"prompt is too long: {prompt} tokens > {limit} maximum", CODE
            )
        asked = self.max_tokens or 1
        return RequestRefused(
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
        raise ContextTooLong(prompt_tokens, asked, limit)


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
