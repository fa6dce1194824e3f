"""A fake appliance for the console's tests and benchmark: scripted `/admin/v1/state` snapshots
served over real HTTP on 127.0.0.1, and a deterministic state generator."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from appliance.gpu.simulated import SimulatedGpu
from appliance.policy.routing import RouteKind
from appliance.services.residency.session_kv import NO_DECISION_REASON

ADMIN_KEY = "sk-admin-test"
T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z: snapshots show UTC times, so looks are stable
GIB = 1 << 30
TOOLS = ["shell", "browser", "python", "search", None]
STATUSES = ["open", "open", "succeeded", "failed"]
SIM_DRIVER = "simulated (the sim engine's GPU model; not measured)"
SIM_HBM_BYTES = 150_754_820_096  # the bundled H200 profile's memory
SIM_BASELINE_BYTES = 16_061_374_136  # weights and runtime of its model
SIM_KV_POOL_BYTES = 122_633_060_352
SIM_GPU = SimulatedGpu("NVIDIA H200 sim", SIM_HBM_BYTES, SIM_BASELINE_BYTES, SIM_KV_POOL_BYTES)


def make_state(
    n_sessions: int = 12,
    *,
    n_tasks: int | None = None,
    gpus: int = 2,
    workers: int = 2,
    seed: int = 7,
    time_s: float = T0,
    tick: int = 0,
    simulated: bool = False,
) -> dict[str, Any]:
    """A plausible snapshot shaped exactly as the server publishes one (AdminState), with
    only the kinds, codes and reasons the product emits (its own enums and constants).

    `tick` moves the clock and idle times forward so that successive snapshots differ.
    `simulated`: the simulated engine's state: one modelled GPU per worker, said so in
    `gpu_driver`.
    """
    rng = random.Random(seed)
    now = time_s + tick * 0.5
    ws = [
        {
            "id": f"w{i}",
            "engine": "sim",
            "url": f"http://127.0.0.1:{8100 + i}",
            "gpus": [i] if i < gpus else [],
            "restarts": i,
            "healthy": i != 3,
            "state": "awake",
            "lifecycle": "healthy",
            "sleep_level": None,
            "last_wake_s": None,
            "draining": False,
            "running": 3 + i,
            "waiting": i,
            "kv_usage": round(0.41 + 0.17 * i, 3),
            "prefix_hit_rate": round(0.62 + 0.05 * i, 3),
            "prefill_slowdown": round(1.0 + 0.12 * i, 3),
            "gpu_busy_s": 1800.0 + 250.0 * i,
            "gpu_idle_s": 600.0 - 100.0 * i,
        }
        for i in range(workers)
    ]
    gs = [
        {
            "index": i,
            "name": "NVIDIA H200",
            "mem_total_bytes": 141 * GIB,
            "mem_used_bytes": (88 + 21 * i) * GIB,
            "util": round(0.55 + 0.2 * i, 2),
            "temp_c": 51.0 + 6 * i,
            "power_w": 402.0 + 55 * i,
        }
        for i in range(gpus)
    ]
    if simulated:
        for w in ws:
            w["gpus"] = []
        gs = [
            sim_gpu(i, w["kv_usage"], w["running"] / (w["running"] + 1)) for i, w in enumerate(ws)
        ]
    n_tasks = n_tasks if n_tasks is not None else max(1, n_sessions // 2)
    tasks: list[dict[str, Any]] = []
    for i in range(n_tasks):
        parent = None
        if i >= 2 and rng.random() < 0.6:
            parent = f"task-{rng.randrange(0, max(1, i // 3 + 1)):04d}"
        tasks.append(
            {
                "id": f"task-{i:04d}",
                "parent_id": parent,
                "tenant": ["alice", "bob"][i % 2],
                "task_class": ["code", "research", None][i % 3],
                "status": STATUSES[i % len(STATUSES)],
                "deadline_at": now + 30 + 7 * i if i % 3 != 2 else None,
                "tokens": 1000 + 137 * i,
                "cost": None,
                "children": [],
            }
        )
    by_id = {t["id"]: t for t in tasks}
    for t in tasks:
        if t["parent_id"] is not None:
            by_id[t["parent_id"]]["children"].append(t["id"])
    sessions = []
    for i in range(n_sessions):
        gpu_tokens = rng.randrange(0, 60_000)
        host_tokens = gpu_tokens // 2 if i % 4 == 1 else 0  # part of it also in host memory
        sessions.append(
            {
                "id": f"sess-{i:05d}",
                "tenant": ["alice", "bob", "carol"][i % 3],
                "task_id": f"task-{i % n_tasks:04d}",
                "worker": f"w{i % max(1, workers)}",
                "resident_tokens": {"gpu": gpu_tokens, "host": host_tokens},
                "resident_bytes": {"gpu": gpu_tokens * 131072, "host": host_tokens * 131072},
                "idle_s": round(rng.random() * 120 + tick * 0.5, 3),
                "turns": rng.randrange(1, 40),
                "tool_class": TOOLS[i % len(TOOLS)],
                "expected_wait_s": [2.0, 15.0, 0.5, 4.0, None][i % 5],
                "decision": None,
                "reason": NO_DECISION_REASON,
            }
        )
    return {
        "time": now,
        "workers": ws,
        "gpus": gs,
        "gpu_driver": SIM_DRIVER if simulated else ("580.159.04" if gs else None),
        "sessions": sessions,
        "tasks": tasks,
        "costs": {},
        "admission": {},
        "routing": {RouteKind.PREFIX_RESIDENT: 40 + tick, RouteKind.LEAST_TTFT: 9},
    }


def sim_gpu(index: int, kv_usage: float, util: float) -> dict[str, Any]:
    """A simulated GPU as the sim engine's model reads it after a long while at this load:
    its power at `util`, its temperature settled there (appliance/gpu/simulated.py)."""
    power = SIM_GPU.power_w(util)
    return {
        "index": index,
        "name": SIM_GPU.name,
        "mem_total_bytes": SIM_HBM_BYTES,
        "mem_used_bytes": SIM_BASELINE_BYTES + round(kv_usage * SIM_KV_POOL_BYTES),
        "util": util,
        "temp_c": round(SIM_GPU.steady_temp_c(power), 1),
        "power_w": round(power, 1),
        "kv_bytes": round(kv_usage * SIM_KV_POOL_BYTES),
    }


RESTING = [("asleep", 2), ("waking", None), ("stopped", None)]
"""The power states `rest_workers` puts the workers after the first in, in turn (each also
its supervisor's state of that name)."""


def rest_workers(state: dict[str, Any]) -> dict[str, Any]:
    """The state with its workers after the first asleep (level 2), waking and stopped, in
    turn, as the appliance shows them: not healthy, no load; the first woke once, in 3.2 s."""
    state["workers"][0]["last_wake_s"] = 3.2
    for w, (power, level) in zip(state["workers"][1:], RESTING, strict=False):
        w.update(
            state=power,
            lifecycle=power,
            sleep_level=level,
            healthy=False,
            running=None,
            waiting=None,
            kv_usage=None,
            prefix_hit_rate=None,
        )
    return state


@dataclass
class Request:
    method: str
    path: str
    authorization: str | None


@dataclass
class Reply:
    status: int
    body: bytes
    content_type: str = "application/json"


@dataclass
class FakeAppliance:
    """Serves `state` at GET /admin/v1/state (operator key `ADMIN_KEY`), scripted replies for
    other routes, and can go away and come back on the same port (`down()` / `up()`)."""

    state: dict[str, Any] = field(default_factory=make_state)
    routes: dict[tuple[str, str], Reply] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    port: int = 0
    _body: bytes = b""
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _open: set[socket.socket] = field(default_factory=set)
    on_state: Callable[[], None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_state(self, state: dict[str, Any]) -> None:
        body = json.dumps(state).encode()
        with self._lock:
            self.state, self._body = state, body

    def cycle(self, states: list[dict[str, Any]]) -> None:
        """Serve these snapshots in turn, one per request (encoded once, up front)."""
        bodies = [json.dumps(s).encode() for s in states]
        turn = [0]

        def next_body() -> None:
            turn[0] += 1
            with self._lock:
                self._body = bodies[turn[0] % len(bodies)]

        self.set_state(states[0])
        self.on_state = next_body

    def state_requests(self) -> int:
        return sum(1 for r in self.requests if r.path == "/admin/v1/state")

    def up(self) -> FakeAppliance:
        if not self._body:
            self.set_state(self.state)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                fake._open.add(self.connection)

            def finish(self) -> None:
                fake._open.discard(self.connection)
                super().finish()

            def _reply(self, reply: Reply) -> None:
                self.send_response(reply.status)
                self.send_header("Content-Type", reply.content_type)
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                auth = self.headers.get("Authorization")
                fake.requests.append(Request(method, self.path, auth))
                if auth != f"Bearer {ADMIN_KEY}":
                    self._reply(_error(401, "missing or unknown API key", "invalid_api_key"))
                    return
                scripted = fake.routes.get((method, self.path))
                if scripted is not None:
                    self._reply(scripted)
                elif method == "GET" and self.path == "/admin/v1/state":
                    with fake._lock:
                        body = fake._body
                    if fake.on_state is not None:
                        fake.on_state()
                    self._reply(Reply(200, body))
                else:  # what Starlette answers for a route it does not have
                    self._reply(Reply(404, b"Not Found", "text/plain; charset=utf-8"))

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

        server = _Server(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()
        return self

    def down(self) -> None:
        """Goes away like a crashed appliance: open connections are cut, new ones refused
        until `up()`."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for conn in list(self._open):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                conn.close()
        self._open.clear()

    def wait_for_state_requests(self, n: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.state_requests() < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.state_requests()} of {n} state requests")
            time.sleep(0.01)


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that went away
            super().handle_error(request, client_address)


def _error(status: int, message: str, code: str) -> Reply:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": code}}
    return Reply(status, json.dumps(body).encode())


def json_reply(status: int, body: dict[str, Any]) -> Reply:
    return Reply(status, json.dumps(body).encode())
