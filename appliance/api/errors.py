"""OpenAI-style error responses: `{"error": {"message", "type", "code"}}` with the right status."""

from __future__ import annotations

import math

from starlette.responses import JSONResponse

from appliance.domain.errors import ApplianceError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    431: "request_too_large",
    503: "service_unavailable",
}


class RequestRefused(ApplianceError):
    """A request the API refuses; `code` is a stable machine-readable reason, `kind` the
    error's `type` where it is not the status's usual one."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        *,
        param: str | None = None,
        kind: str | None = None,
    ):
        super().__init__(message, code=code, http_status=status)
        self.param = param
        self.kind = kind


def error_body(
    status: int, message: str, code: str, *, param: str | None = None, kind: str | None = None
) -> dict[str, dict[str, str | None]]:
    """`{"error": {"message", "type", "param", "code"}}`: what every refusal of the API says."""
    return {
        "error": {
            "message": message,
            "type": kind or _TYPES.get(status, "api_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int,
    message: str,
    code: str,
    *,
    param: str | None = None,
    retry_after_s: float | None = None,
    kind: str | None = None,
) -> JSONResponse:
    """The error JSON; `retry_after_s` becomes a `Retry-After` header in whole seconds (>= 1)."""
    body = error_body(status, message, code, param=param, kind=kind)
    headers = None
    if retry_after_s is not None:
        headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))}
    return JSONResponse(body, status_code=status, headers=headers)


def from_exception(exc: ApplianceError) -> JSONResponse:
    return error_response(
        exc.http_status,
        exc.message,
        exc.code,
        param=getattr(exc, "param", None),
        retry_after_s=getattr(exc, "retry_after_s", None),
        kind=getattr(exc, "kind", None),
    )
