"""vLLM 0.32's error responses, as the simulated worker answers them.

Model of the world (vLLM `serve/exception_handling/`, FastAPI's RequestValidationError):
pydantic errors become 400 `{"error": {"message": "N validation error(s): ...", "type":
"Bad Request", "param": "body.<field>", "code": 400}}`. vLLM's own checks (its
`VLLMValidationError`) become 400 "BadRequestError" with `param` set and
"(parameter=..., value=...)" appended to the message; plain ValueErrors 400
"BadRequestError" with `param` null; an unknown model 404 "NotFoundError" with
`param: "model"`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

_MAX_ERRORS, _MAX_INPUT_CHARS, _MAX_ERROR_CHARS = 10, 200, 1000
_BRACKETED = re.compile(r"[\[\](){}]")
_PYDANTIC_MARKERS = (
    "function-wrap function-after function-before function-plain json-or-python "
    "lax-or-strict chain default nullable tagged-union union call arguments is-instance "
    "is-subclass callable str int float bool bytes bytearray list tuple dict set frozenset "
    "complex none nonetype"
)
_INTERNAL_LOC = frozenset(_PYDANTIC_MARKERS.split())


class ApiError(Exception):
    """An error response: status code plus vLLM's `{"error": {...}}` body."""

    def __init__(self, status: int, err_type: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.err_type = err_type
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


def vllm_validation_error(
    message: str, *, parameter: str | None = None, value: Any = None
) -> ApiError:
    """vLLM's `VLLMValidationError`, as its exception handler renders it."""
    extras = [f"parameter={parameter}"] if parameter is not None else []
    if value is not None:
        extras.append(f"value={value}")
    text = f"{message} ({', '.join(extras)})" if extras else message
    return ApiError(400, "BadRequestError", text, parameter)


def bad_request(message: str) -> ApiError:
    """A plain ValueError in vLLM: 400 BadRequestError without a param."""
    return ApiError(400, "BadRequestError", message)


def model_not_found(model: str, served: Sequence[str]) -> ApiError:
    return ApiError(
        404,
        "NotFoundError",
        f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.",
        "model",
    )


def _clean_loc(loc: Sequence[Any]) -> str:
    parts = [str(p) for p in loc if not _internal(str(p))]
    return ".".join(parts) if parts else ".".join(str(p) for p in loc)


def _internal(segment: str) -> bool:
    return bool(_BRACKETED.search(segment)) or segment.lower() in _INTERNAL_LOC


def _summarize(value: Any) -> str:
    if isinstance(value, str):
        return (
            value[:_MAX_INPUT_CHARS] + "...[truncated]" if len(value) > _MAX_INPUT_CHARS else value
        )
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text[:_MAX_INPUT_CHARS] + "...[truncated]" if len(text) > _MAX_INPUT_CHARS else text


def request_validation_error(errors: Sequence[Any]) -> ApiError:
    """400 "Bad Request" listing pydantic-style errors (dicts with `loc`) or plain strings."""
    lines = []
    for err in errors[:_MAX_ERRORS]:
        if isinstance(err, Mapping):
            shown = dict(err)
            if "input" in shown:
                shown["input"] = _summarize(shown["input"])
            shown["loc"] = _clean_loc(tuple(shown.get("loc", ())))
            if isinstance(shown.get("ctx"), Mapping):
                shown["ctx"] = {k: _ctx_value(v) for k, v in shown["ctx"].items()}
            text = str(shown)
        else:
            text = str(err)
        if len(text) > _MAX_ERROR_CHARS:
            text = text[:_MAX_ERROR_CHARS] + "...[truncated]"
        lines.append(text)
    count = len(errors)
    label = "error" if count == 1 else "errors"
    message = f"{count} validation {label}:\n" + "".join(f"  {line}\n" for line in lines)
    if count > len(lines):
        message += f"  ...and {count - len(lines)} more {label}\n"
    first = errors[0] if errors else None
    param = _clean_loc(first["loc"]) if isinstance(first, Mapping) and first.get("loc") else None
    return ApiError(400, "Bad Request", message.rstrip(), param)


def _ctx_value(value: Any) -> Any:
    return value if isinstance(value, str | int | float | bool | type(None)) else str(value)
