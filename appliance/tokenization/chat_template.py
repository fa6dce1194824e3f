"""Chat templates as transformers renders them for vLLM: compiled in a Jinja sandbox with
transformers' settings (`trim_blocks`, `lstrip_blocks`, `loopcontrols`, `tojson`,
`raise_exception`, `strftime_now`), over messages normalised as vLLM hands them over (list
content becomes its text parts joined by newlines, missing content the empty string).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The template of the project's tiny test model, used when no model directory is given."""


class ChatTemplateError(ValueError):
    """The chat cannot be rendered (vLLM answers 400 BadRequestError)."""


def compile_chat_template(source: str) -> jinja2.Template:
    """As transformers compiles chat templates (`_cached_compile_jinja_template`)."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to the template ("string" content format)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        msg = dict(message)
        content = msg.get("content")
        if content is None:
            msg["content"] = ""
        elif isinstance(content, list):
            msg["content"] = "\n".join(
                str(part.get("text", ""))
                for part in content
                if isinstance(part, Mapping) and part.get("type", "text") == "text"
            )
        out.append(msg)
    return out
