"""What the API answers while the appliance starts: its port is bound at once, before the
workers are up (a vLLM worker takes a minute or more), so a restarted appliance holds its
port again within a second and clients hear "starting, retry" instead of a refused
connection. `/health` says `starting` (503); every other path is a 503 `starting` with
Retry-After. The daemon swaps in the wired app once the workers serve."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from appliance import __version__
from appliance.api.errors import error_response

RETRY_AFTER_S = 5.0


async def starting_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    if scope["path"] == "/health":
        response = JSONResponse({"status": "starting", "version": __version__}, status_code=503)
    else:
        response = error_response(
            503,
            "the appliance is starting: its workers are not serving yet",
            "starting",
            retry_after_s=RETRY_AFTER_S,
        )
    await response(scope, receive, send)
