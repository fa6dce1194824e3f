"""vLLM's development endpoints on a simulated worker (VLLM_SERVER_DEV_MODE=1), in vLLM
0.32's shapes (`entrypoints/serve/dev/`): `POST /reset_prefix_cache` -> {"success": bool};
`POST /sleep?level=0|1|2&mode=abort` -> {"status": "sleeping", "level": n};
`POST /wake_up` -> {"status": "awake", "tags": null}; `GET /is_sleeping` ->
{"is_sleeping": bool}; `POST /collective_rpc` {"method": ...} -> 200 with no body (what
vLLM answers when the workers return nothing, as `reload_weights` does). A level outside
0..2 is FastAPI's 422; a sleep whose cache reset fails is a bare 500, as in vLLM.
Only the "abort" pause mode is modelled; "wait" and "keep" are answered 400 here."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from appliance.sim.runtime.sleep_mode import SleepRefused

if TYPE_CHECKING:
    from appliance.sim.runtime.worker import SimWorker

DevRoute = tuple[str, Callable[[Request], Awaitable[Response]], list[str]]


def _level_error(raw: str) -> Response:
    detail = {
        "type": "int_parsing" if not raw.lstrip("-").isdigit() else "less_than_equal",
        "loc": ["query", "level"],
        "msg": "Input should be 0, 1 or 2",
        "input": raw,
    }
    return JSONResponse({"detail": [detail]}, status_code=422)


def dev_routes(worker: SimWorker) -> list[DevRoute]:
    """The dev-mode routes of `worker`, as (path, handler, methods)."""

    async def reset_prefix_cache(request: Request) -> Response:
        return JSONResponse({"success": worker.reset_prefix_cache()})

    async def sleep(request: Request) -> Response:
        raw = request.query_params.get("level", "1")
        if not raw.isdigit() or int(raw) > 2:
            return _level_error(raw)
        if request.query_params.get("mode", "abort") != "abort":
            return JSONResponse({"detail": "the simulator models mode=abort only"}, 400)
        try:
            await worker.sleep_mode.sleep(int(raw))
        except SleepRefused:
            return PlainTextResponse("Internal Server Error", status_code=500)
        return JSONResponse({"status": "sleeping", "level": int(raw)})

    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None
        await worker.sleep_mode.wake_up()
        return JSONResponse({"status": "awake", "tags": tags})

    async def is_sleeping(request: Request) -> Response:
        return JSONResponse({"is_sleeping": worker.sleep_mode.sleeping})

    async def collective_rpc(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except json.JSONDecodeError as exc:
            return JSONResponse({"detail": f"JSON decode error: {exc}"}, 400)
        if not isinstance(body, dict) or body.get("method") is None:
            return JSONResponse({"detail": "Missing 'method' in request body"}, 400)
        return Response(status_code=200)

    return [
        ("/reset_prefix_cache", reset_prefix_cache, ["POST"]),
        ("/sleep", sleep, ["POST"]),
        ("/wake_up", wake_up, ["POST"]),
        ("/is_sleeping", is_sleeping, ["GET"]),
        ("/collective_rpc", collective_rpc, ["POST"]),
    ]
