"""Latency the session router adds over calling a worker directly, beside vllm-router's.

    .venv/bin/python benchmarks/router_overhead.py [--out router_overhead.json]
        [--concurrency 50,200] [--modes nonstream,stream] [--turns 4] [--think-s 1,3]
        [--vllm-router /tmp/vr-venv/bin/vllm-router | --no-vllm-router]
        [--vllm-router-policy cache_aware]
        [--paths direct,tcp-relay,http-relay,appliance,appliance-granian,vllm-router]
        [--granian /tmp/granian-pkgs] [--router-cpus 1]
        [--py-spy PATH | --cprofile FILE] [--keep-logs DIR]

One run (about 5 minutes here) starts two simulated H200 workers (one process each, as
`appliance up` runs them), `appliance up --engine external` in front of them and, when its
binary is found, the Rust `vllm-router` (PyPI `vllm-router`, in a venv of its own: `python3
-m venv /tmp/vr-venv && /tmp/vr-venv/bin/pip install vllm-router`; never a dependency of the
product) in front of the same two workers, with its default `cache_aware` policy, and a
`tcp-relay` (one per worker: bytes pumped between client and worker, no HTTP parsed), the
floor any router in a process of its own pays, and an `http-relay` (one per worker: the
appliance's own HTTP machinery, its HTTP/1.1 server in front and its HTTP/1.1 client
behind, with the body parsed and written again by orjson and nothing decided), the floor of
a router built from those parts. When granian is found in `--granian` (a folder holding the
package: `pip install --target /tmp/granian-pkgs granian`; never a dependency of the
product), an `appliance-granian`: a second `appliance up --engine external` in front of the
same workers, the same code and settings, its API (the same ASGI app) served by granian's
embedded Rust HTTP/1.1 server on the appliance's event loop instead of the appliance's own
server (appliance/api/http_server/server.py); both appliances share a secret, so tenant salts and
block hashes are the same. Then, for each concurrency and mode, the same
traffic goes (a) straight to the workers, each session to the worker that holds its context,
(b) through each relay, (c) through the appliance (and appliance-granian) and (d) through
vllm-router.
`--router-cpus` pins the relays and the routers to those CPUs and everything else to the rest.
Everything is loopback, every loop is bounded, and the script stops what it started.

Traffic: N concurrent agent sessions. Each has its own ~7.8k-token context, prefilled once
in a warm-up (through vllm-router, whose placement the direct path then copies; the
appliance learns where every block is from the workers' KV events, and is sent each
context once as well, so that both routers have seen every context once). In each measured
phase every session is a new session (new X-Session-ID / X-Task-ID) over its context, as a
new task over the same repository would be, and runs `--turns` turns: each re-sends the
whole chat (context + every earlier tool output and reply: 8.0k-8.4k-token prompts), asks
for 16 tokens, then "runs a tool" for a uniform `--think-s` pause. Sessions start spread
over twice the longest pause, and each has its own HTTP client and kept-alive connection.
Every path of a concurrency and mode gets the same start times and pauses (common random
numbers: the paths meet the same bursts of arrivals); the tool outputs are new each phase.
The direct and vllm-router requests carry the appliance's tenant `cache_salt` and a
`session_id`, so the workers see the same token ids, block hashes and cache hits on all
three paths (`cache hit` in the table checks it).

What "added latency" means. The simulated engine's own time (queueing, prefill, decode on
the modelled GPU) varies with load and placement, so client-side latency distributions
alone (also reported: each path's time-to-first-byte p50/p99 and its difference from the
direct path's) mix the router's cost with the engine's. So each worker runs behind a thin
ASGI wrapper that stamps, on the machine-wide CLOCK_MONOTONIC the client shares, when a
request entered the worker's application and when its first and last body bytes left; the
request is recognised by a unique `user` field in its body. For every request:

    overhead = (client first byte - client send) - (worker first byte - worker entry)

i.e. the time outside the worker's application: the client's HTTP stack, the router
(parsing, tokenising, placement, forwarding, relaying the answer), the extra loopback hop,
and the wait for the worker's event loop to take the request up. The direct path's overhead
is the floor every path pays; a router's **added latency** is its overhead's p50 (p99)
minus the direct path's p50 (p99), same concurrency and mode. The JSON also has it for the
last byte, the inbound part alone, and first turns (a new session: the context is
tokenised and hashed, unless shared) apart from later turns. `router CPU/req` is the router
process's CPU time in the phase, less its CPU at rest (health and /metrics polling, KV
events; measured for 2 s before the phase), per request. `appliance_forward_ms` is the
appliance's own time per turn before it forwards it (its `appliance_forward_seconds`
histogram, read before and after the phase): the mean, and the share of turns at or under
each bound. `appliance_prefill_slowdown` is each worker's prefill speed as the appliance
measured it after the phase (1: not measured; the simulated workers run at the profile's
speed, and a worker measured slower than the other draws sessions away from it).

Before anything starts, `cold_path.py` (beside this script) times pieces of a router's
decision work hot and after a pause, on the quiet machine (`cold_path_us` in the JSON): on
a box whose caches go cold between turns, a router's own time is mostly that.

Caveats, all of this machine: 2 cores run the client, both workers and the router (and
whatever else is running: `machine_busy` in the JSON is the share of both cores in use
during the phase, every process counted), so a router's CPU also slows the workers and the
client; the figures are what this box gives, an upper bound of what a router on cores of
its own adds. At 200 sessions the workers' own event loops (each tokenises every 8k
prompt) add queueing before the stamp that all paths share, which widens every p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cold_path  # benchmarks/cold_path.py, beside this script
import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests/: the word list and `appliance keys add`, shared

from appliance.config.keystore import KEYS_FILE  # noqa: E402
from appliance.domain.worker import WORKER_KEEPALIVE_S  # noqa: E402
from appliance.engines.clients.metrics import parse as parse_metrics  # noqa: E402
from tests.running import add_key  # noqa: E402
from tests.words import numbered_words as words  # noqa: E402

BIN = Path(sys.executable).parent
MODEL = "sim"
TENANT = "bench"
MODEL_PATHS = ("/v1/chat/completions", "/v1/completions")
FORWARD_SERIES = tuple(f"appliance_forward_seconds_{s}" for s in ("bucket", "sum", "count"))
_USER = re.compile(rb'"user"\s*:\s*"([^"]+)"')


# --- the timing wrapper around one simulated worker (runs in the worker's process) ---------


class StampedApp:
    """ASGI wrapper: per model request, CLOCK_MONOTONIC ns at arrival, first body byte and
    last body byte, keyed by the body's `user` field; GET /bench/timings hands them over."""

    def __init__(self, app: Any, name: str) -> None:
        self.app = app
        self.name = name
        self.records: dict[str, list[int]] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] == "/bench/timings":
            records, self.records = self.records, {}
            body = json.dumps({"worker": self.name, "records": records}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        if scope["path"] not in MODEL_PATHS:
            await self.app(scope, receive, send)
            return
        stamps = [time.monotonic_ns(), 0, 0]
        chunks: list[bytes] = []

        async def receive_body() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        async def stamped_send(message: Any) -> None:
            if message["type"] == "http.response.body":
                now = time.monotonic_ns()
                if message.get("body") and not stamps[1]:
                    stamps[1] = now
                if not message.get("more_body", False):
                    stamps[2] = now
            await send(message)

        try:
            await self.app(scope, receive_body, stamped_send)
        finally:
            found = _USER.search(b"".join(chunks))
            if found:
                self.records[found.group(1).decode()] = stamps


def serve_worker(port: int, kv_endpoint: str, max_model_len: int) -> None:
    """One simulated worker as `appliance up --engine sim` starts it, behind StampedApp."""
    from appliance import eventloop
    from appliance.sim.entrypoints.server import create_app, make_server
    from appliance.sim.runtime.worker import SimWorker, WorkerConfig

    config = WorkerConfig(
        served_model_name=MODEL,
        port=port,
        block_size=32,
        max_model_len=max_model_len,
        hash_algo="sha256_cbor",
        python_hash_seed="0",
        kv_events_endpoint=kv_endpoint,
    )

    async def main() -> None:
        worker = SimWorker(config)
        await worker.start()
        server = make_server(StampedApp(create_app(worker), f"w{port}"), "127.0.0.1", port)
        try:
            await server.serve()
        finally:
            await worker.stop()

    eventloop.run(main())


def serve_relay(listen_ports: list[int], target_ports: list[int]) -> None:
    """The least a router in its own process can be: bytes relayed between the client and
    one worker over loopback TCP, no HTTP parsed (uvloop). Its added latency is the floor
    the extra process and the two extra hops cost on this machine."""
    import asyncio

    from appliance import eventloop

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    def relay_to(target: int) -> Any:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

        return handle

    async def main() -> None:
        servers = [
            await asyncio.start_server(relay_to(t), "127.0.0.1", port)
            for port, t in zip(listen_ports, target_ports, strict=True)
        ]
        await asyncio.gather(*(srv.serve_forever() for srv in servers))

    eventloop.run(main())


def serve_http_relay(listen_ports: list[int], target_ports: list[int]) -> None:
    """A router with nothing to decide, built from the appliance's own HTTP parts: its
    HTTP/1.1 server (as `appliance up` runs it) and a bare ASGI app in front, its HTTP/1.1
    client behind, the request body parsed and written again (orjson), the answer passed
    back whole or as it arrives."""
    import asyncio

    import orjson

    from appliance import eventloop
    from appliance.api.http_server.server import ApiServer
    from appliance.engines.clients.http1 import Http1Pool

    def app_for(target: int) -> Any:
        pool = Http1Pool(
            "127.0.0.1",
            target,
            connect_timeout_s=5,
            read_timeout_s=600,
            keepalive_s=WORKER_KEEPALIVE_S - 1,
        )

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            body = (await receive())["body"]  # the server hands over the whole body
            if body:
                body = orjson.dumps(orjson.loads(body))
            headers = (("Content-Type", "application/json"),)
            answer = await pool.request(scope["method"], scope["path"], body, headers)
            kind = dict(answer.headers).get(b"content-type", b"application/json")
            await send(
                {
                    "type": "http.response.start",
                    "status": answer.status,
                    "headers": [(b"content-type", kind)],
                }
            )
            async for data in answer.chunks():
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

        return app

    async def main() -> None:
        servers = [
            ApiServer(app_for(t), "127.0.0.1", port)
            for port, t in zip(listen_ports, target_ports, strict=True)
        ]
        await asyncio.gather(*(server.serve() for server in servers))

    eventloop.run(main())


def serve_appliance_granian(granian_path: str, up_args: list[str]) -> None:
    """`appliance up` as the product runs it, its API (the same ASGI app) served by granian's
    embedded server (granian.server.embed: the Rust HTTP/1.1 server on the appliance's own
    event loop, one Rust runtime thread) instead of the appliance's own HTTP/1.1 server.
    granian is never a dependency of the product: it comes from `granian_path` (`pip install
    --target DIR granian`, or a venv's site-packages)."""
    import runpy

    sys.path.insert(0, granian_path)
    from granian.constants import HTTPModes, Interfaces
    from granian.log import LogLevels
    from granian.server.embed import Server

    from appliance.start import daemon

    def stamped(app: Any) -> Any:
        """The appliance's own server tells the app when the whole request had arrived
        (`extensions.appliance.received_at`: the appliance's own time per turn, the queue
        time it records); granian calls the app at the head, so the stamp is taken when the
        last body message is received."""

        async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            mine: dict[str, Any] = {"received_at": None}
            scope["extensions"] = {**(scope.get("extensions") or {}), "appliance": mine}

            async def receive_stamped() -> Any:
                message = await receive()
                if message["type"] == "http.request" and not message.get("more_body"):
                    mine["received_at"] = time.monotonic()
                return message

            await app(scope, receive_stamped, send)

        return asgi

    class GranianApi:
        """What the daemon needs of its API server: `serve()` until cancelled, `started`."""

        def __init__(self, app: Any, host: str, port: int) -> None:
            self.started = False
            self._server = Server(
                stamped(app),
                address=host,
                port=port,
                interface=Interfaces.ASGINL,
                http=HTTPModes.http1,
                websockets=False,
                backlog=2048,
                log_level=LogLevels.warning,
            )
            self._server.on_startup(lambda: setattr(self, "started", True))

        async def serve(self) -> None:
            task = asyncio.ensure_future(self._server.serve())
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                self._server.stop()
                await task
                raise

    daemon._api_server = lambda app, settings: GranianApi(  # type: ignore[assignment]
        app, settings.server.host, settings.server.port
    )
    sys.argv = ["appliance", "up", *up_args]
    runpy.run_module("cli.main", run_name="__main__")


def granian_found(path: str) -> bool:
    return (Path(path) / "granian" / "__init__.py").is_file()


# --- processes ------------------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class Procs:
    """Everything this script starts, each in its own process group, stopped on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        cpus: set[int] | None = None,
    ) -> None:
        """Starts `argv`; with `cpus`, every thread it will have runs on those CPUs only."""
        log = (self.log_dir / f"{name}.log").open("wb")
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.procs[name] = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=pin,
        )

    def check(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"{name} exited ({p.returncode}):\n{tail}")

    def stop(self) -> None:
        spy = self.procs.pop("py-spy", None)
        if spy is not None and spy.poll() is None:  # SIGINT: py-spy writes its profile
            spy.send_signal(signal.SIGINT)
            try:
                spy.wait(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def all_cpu_s(self) -> dict[str, float]:
        """CPU seconds so far of each process started here, and of this one (the client)."""
        out = {name: self.cpu_s(name) for name in self.procs if name != "py-spy"}
        out["client"] = sum(psutil.Process().cpu_times()[:2])
        return out

    def cpu_s(self, name: str) -> float:
        """CPU seconds of the process and its children so far."""
        try:
            proc = psutil.Process(self.procs[name].pid)
            total = sum(proc.cpu_times()[:2])
            for child in proc.children(recursive=True):
                total += sum(child.cpu_times()[:2])
            return total
        except psutil.Error:
            return math.nan


def wait_http(url: str, procs: Procs, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs.check()
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer 200 within {timeout_s:.0f} s")


def tenant_salt(data_dir: Path) -> str:
    """The cache_salt the appliance gives this tenant's requests (tenancy.TenantSalts)."""
    from appliance.services.sessions.tenancy import TenantSalts

    secret = bytes.fromhex((data_dir / "secret.key").read_text().strip())
    return TenantSalts(secret)(TENANT)


# --- traffic --------------------------------------------------------------------------------


@dataclass
class TrafficPath:
    name: str
    url: Callable[[int], str]
    """Base URL for a session (index)."""
    headers: Callable[[str], dict[str, str]]
    extra: Callable[[str], dict[str, Any]]
    """Body fields for a session id."""
    process: str | None


@dataclass
class Sample:
    rid: str
    t0: int
    first: int
    end: int
    status: int
    worker: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    turn: int = 0


@dataclass
class Phase:
    path: str
    concurrency: int
    mode: str
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    router_cpu_s: float | None = None
    router_idle_cpu_per_s: float = 0.0
    machine_busy: float | None = None
    """Share of all cores busy during the phase (every process on the machine)."""
    cpu_ms_per_request: dict[str, float] = field(default_factory=dict)
    in_flight_s: float = 0.0


async def one_turn(
    client: httpx.AsyncClient,
    path: TrafficPath,
    session: int,
    sid: str,
    messages: list[dict[str, str]],
    stream: bool,
    max_tokens: int,
) -> tuple[Sample, str]:
    rid = f"bench-{uuid.uuid4().hex}"
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": stream,
        **path.extra(sid),
        "user": rid,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    raw = json.dumps(body).encode()
    headers = {"content-type": "application/json", **path.headers(sid)}
    url = f"{path.url(session)}/v1/chat/completions"
    t0 = time.monotonic_ns()
    first = 0
    parts: list[bytes] = []
    async with client.stream("POST", url, content=raw, headers=headers) as response:
        async for chunk in response.aiter_raw():
            if not first:
                first = time.monotonic_ns()
            parts.append(chunk)
        end = time.monotonic_ns()
        status = response.status_code
        worker = response.headers.get("x-appliance-worker")
    text = b"".join(parts)
    sample = Sample(rid, t0, first or end, end, status, worker)
    if status != 200:
        raise RuntimeError(f"{path.name}: HTTP {status}: {text[:300]!r}")
    content, usage = _answer(text, stream)
    sample.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    sample.cached_tokens = int(details.get("cached_tokens") or 0)
    return sample, content


def _answer(text: bytes, stream: bool) -> tuple[str, dict[str, Any]]:
    if not stream:
        body = json.loads(text)
        return body["choices"][0]["message"]["content"] or "", body.get("usage") or {}
    content, usage = [], {}
    for line in text.decode().splitlines():
        if not line.startswith("data:") or line.strip() == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']}")
        for choice in chunk.get("choices") or []:
            content.append((choice.get("delta") or {}).get("content") or "")
        usage = chunk.get("usage") or usage
    return "".join(content), usage


async def run_phase(
    path: TrafficPath,
    contexts: list[str],
    concurrency: int,
    mode: str,
    args: argparse.Namespace,
    phase_no: int,
    cpu: Callable[[], float] | None,
    procs_cpu: Callable[[], dict[str, float]],
) -> Phase:
    phase = Phase(path.name, concurrency, mode)
    # One client (one kept-alive connection) per session, as separate agents have: a single
    # pool of hundreds of connections costs httpx's pool O(n) per request and skews the
    # client's own timings at 200 sessions.
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    # Plain HTTP, but httpx builds a TLS context for every client unless given one: 30 ms
    # of the client's event loop per session start, which delayed every request in flight
    # (all paths alike) and made up the first turns' tails.
    tls = ssl.create_default_context()
    lo, hi = args.think_s
    in_flight = [0, 0.0, time.monotonic()]  # count, integral, last change

    def flight(delta: int) -> None:
        now = time.monotonic()
        in_flight[1] += in_flight[0] * (now - in_flight[2])
        in_flight[0] += delta
        in_flight[2] = now

    async def session(i: int) -> None:
        async with httpx.AsyncClient(limits=limits, timeout=120, verify=tls) as client:
            await run_session(client, i)

    async def run_session(client: httpx.AsyncClient, i: int) -> None:
        rng = random.Random(f"{phase_no}-{i}")  # the tool outputs: new in every phase
        # Start and tool pauses are the same on every path of a concurrency and mode, so the
        # paths are compared under the same bursts of arrivals.
        timing = random.Random(f"{concurrency}-{mode}-{i}")
        sid = f"p{phase_no}-s{i}"
        messages = [{"role": "system", "content": contexts[i]}]
        await asyncio.sleep(timing.uniform(0, 2 * hi))  # sessions do not start in lockstep
        for turn in range(args.turns):
            messages.append({"role": "user", "content": words(rng, args.tool_tokens)})
            flight(+1)
            try:
                sample, content = await one_turn(
                    client, path, i, sid, messages, mode == "stream", args.max_tokens
                )
                sample.turn = turn
            except Exception as exc:  # recorded; the session goes on
                phase.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                content = ""
            else:
                phase.samples.append(sample)
            finally:
                flight(-1)
            messages.append({"role": "assistant", "content": content})
            if turn + 1 < args.turns:
                await asyncio.sleep(timing.uniform(lo, hi))

    if cpu:  # the router's own background work (health, metrics, KV events) at rest
        idle0, t_idle = cpu(), time.monotonic()
        await asyncio.sleep(2.0)
        phase.router_idle_cpu_per_s = (cpu() - idle0) / (time.monotonic() - t_idle)
    cpu0 = cpu() if cpu else None
    by_process0 = procs_cpu()
    machine0 = psutil.cpu_times()
    start = time.monotonic()
    await asyncio.gather(*(session(i) for i in range(concurrency)))
    phase.wall_s = time.monotonic() - start
    machine1 = psutil.cpu_times()
    flight(0)
    phase.in_flight_s = in_flight[1]
    if cpu and cpu0 is not None:
        phase.router_cpu_s = cpu() - cpu0
    idle = (machine1.idle + machine1.iowait) - (machine0.idle + machine0.iowait)
    total = sum(machine1) - sum(machine0)
    phase.machine_busy = 1 - idle / total if total > 0 else None
    n = max(len(phase.samples), 1)
    phase.cpu_ms_per_request = {
        name: round((v - by_process0.get(name, 0.0)) / n * 1000, 2)
        for name, v in procs_cpu().items()
    }
    return phase


async def warm_up(path: TrafficPath, contexts: list[str], width: int) -> dict[int, str]:
    """One turn per session, `width` at a time, so every context is in some worker's cache;
    returns the request ids by session for the placement lookup."""
    rids: dict[int, str] = {}
    sem = asyncio.Semaphore(width)
    async with httpx.AsyncClient(timeout=300) as client:

        async def one(i: int) -> None:
            async with sem:
                messages = [
                    {"role": "system", "content": contexts[i]},
                    {"role": "user", "content": "warm up"},
                ]
                sample, _ = await one_turn(client, path, i, f"warm-{i}", messages, False, 1)
                rids[i] = sample.rid

        await asyncio.gather(*(one(i) for i in range(len(contexts))))
    return rids


async def collect(worker_urls: list[str]) -> dict[str, tuple[str, list[int]]]:
    out: dict[str, tuple[str, list[int]]] = {}
    async with httpx.AsyncClient(timeout=30) as client:
        for i, url in enumerate(worker_urls):
            records = (await client.get(f"{url}/bench/timings")).json()["records"]
            for rid, stamps in records.items():
                out[rid] = (f"w{i}", stamps)
    return out


# --- figures --------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def forward_histogram(metrics_url: str) -> dict[str, float]:
    """The appliance's `appliance_forward_seconds` (its own time per turn before it is
    forwarded): cumulative counts by upper bound ("+Inf" included), "sum" and "count"."""
    text = httpx.get(metrics_url, timeout=10).text
    return {
        s.labels["le"] if s.name.endswith("_bucket") else s.name.rsplit("_", 1)[1]: s.value
        for s in parse_metrics(text, only=FORWARD_SERIES).samples
    }


def prefill_slowdowns(metrics_url: str) -> dict[str, float]:
    """Each worker's prefill slowdown as the appliance measured it (1: never measured): a
    worker measured slower than the other looks slower to its placement."""
    text = httpx.get(metrics_url, timeout=10).text
    gauge = "appliance_worker_prefill_slowdown"
    return {
        s.labels["worker"]: round(s.value, 3) for s in parse_metrics(text, only=[gauge]).samples
    }


def forward_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The phase's share of turns at or under each bound and their mean, in ms."""
    n = after["count"] - before["count"]
    if n <= 0:
        return {"turns": 0}
    shares = {
        f"<= {float(le) * 1000:g}": round((after[le] - before[le]) / n, 3)
        for le in after
        if le not in ("sum", "count", "+Inf")
    }
    mean = (after["sum"] - before["sum"]) / n * 1000
    return {"turns": int(n), "mean": round(mean, 3), "share": shares}


def summarise(phase: Phase, stamps: dict[str, tuple[str, list[int]]]) -> dict[str, Any]:
    first, end, over_first, over_end, inbound = [], [], [], [], []
    prompt, cached = [], []
    matched: list[tuple[float, Sample]] = []
    missing = 0
    for s in phase.samples:
        first.append((s.first - s.t0) / 1e6)
        end.append((s.end - s.t0) / 1e6)
        prompt.append(s.prompt_tokens)
        cached.append(s.cached_tokens)
        got = stamps.get(s.rid)
        if got is None or not got[1][1]:
            missing += 1
            continue
        arrive, w_first, w_end = got[1]
        over_first.append((s.first - s.t0 - (w_first - arrive)) / 1e6)
        matched.append((over_first[-1], s))
        over_end.append((s.end - s.t0 - (w_end - arrive)) / 1e6)
        inbound.append((arrive - s.t0) / 1e6)
    n = len(phase.samples)
    return {
        "path": phase.path,
        "concurrency": phase.concurrency,
        "mode": phase.mode,
        "requests": n,
        "errors": len(phase.errors),
        "error_examples": phase.errors[:3],
        "unmatched": missing,
        "wall_s": round(phase.wall_s, 2),
        "requests_per_s": round(n / phase.wall_s, 1) if phase.wall_s else None,
        "mean_in_flight": round(phase.in_flight_s / phase.wall_s, 1) if phase.wall_s else None,
        "mean_prompt_tokens": round(sum(prompt) / n) if n else None,
        "cache_hit": round(sum(cached) / sum(prompt), 3) if sum(prompt) else None,
        "machine_busy": round(phase.machine_busy, 3) if phase.machine_busy is not None else None,
        "cpu_ms_per_request": phase.cpu_ms_per_request,
        "router_cpu_ms_per_request": (
            round(phase.router_cpu_s / n * 1000, 2) if phase.router_cpu_s and n else None
        ),
        "router_idle_cpu_ms_per_s": round(phase.router_idle_cpu_per_s * 1000, 2),
        "router_request_cpu_ms": (
            round((phase.router_cpu_s - phase.router_idle_cpu_per_s * phase.wall_s) / n * 1000, 2)
            if phase.router_cpu_s and n
            else None
        ),
        "first_byte_ms": _dist(first),
        "last_byte_ms": _dist(end),
        "overhead_first_ms": _dist(over_first),
        "overhead_last_ms": _dist(over_end),
        "inbound_ms": _dist(inbound),
        "overhead_first_ms_by_turn": {
            "first_turn": _dist([o for o, s in matched if s.turn == 0]),
            "later_turns": _dist([o for o, s in matched if s.turn > 0]),
        },
    }


def _dist(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(pct(values, 0.50), 3),
        "p90": round(pct(values, 0.90), 3),
        "p99": round(pct(values, 0.99), 3),
        "max": round(max(values), 3) if values else math.nan,
        "n": len(values),
    }


def add_differences(rows: list[dict[str, Any]]) -> None:
    base = {(r["concurrency"], r["mode"]): r for r in rows if r["path"] == "direct"}
    for r in rows:
        d = base.get((r["concurrency"], r["mode"]))
        if d is None:
            continue
        for key in ("overhead_first_ms", "overhead_last_ms", "first_byte_ms"):
            r.setdefault("added", {})[key] = {
                q: round(r[key][q] - d[key][q], 3) for q in ("p50", "p90", "p99")
            }


def table(rows: list[dict[str, Any]], target: tuple[float, float]) -> str:
    head = (
        "| path | sessions | mode | requests | in flight | first byte p50 | p99 "
        "| overhead p50 | p99 | **added p50** | **added p99** | first byte diff p50 | p99 "
        "| router CPU/req | cache hit | target |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        a = r.get("added", {})
        ao = a.get("overhead_first_ms", {})
        af = a.get("first_byte_ms", {})
        ok = ""
        if r["path"] != "direct" and ao:
            ok = "met" if ao["p50"] <= target[0] and ao["p99"] <= target[1] else "missed"
        cpu = r["router_request_cpu_ms"]
        lines.append(
            f"| {r['path']} | {r['concurrency']} | {r['mode']} | {r['requests']}"
            f"{' (' + str(r['errors']) + ' err)' if r['errors'] else ''} "
            f"| {r['mean_in_flight']} "
            f"| {r['first_byte_ms']['p50']:.1f} | {r['first_byte_ms']['p99']:.1f} "
            f"| {r['overhead_first_ms']['p50']:.2f} | {r['overhead_first_ms']['p99']:.2f} "
            f"| {_ms(ao.get('p50'))} | {_ms(ao.get('p99'))} "
            f"| {_ms(af.get('p50'))} | {_ms(af.get('p99'))} "
            f"| {'' if cpu is None else f'{cpu:.2f} ms'} | {r['cache_hit']} | {ok} |"
        )
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "" if v is None else f"{v:+.2f}"


# --- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("router_overhead.json"))
    p.add_argument("--concurrency", default="50,200", help="Sessions, comma-separated.")
    p.add_argument("--modes", default="nonstream,stream")
    p.add_argument(
        "--paths", default="direct,tcp-relay,http-relay,appliance,appliance-granian,vllm-router"
    )
    p.add_argument("--turns", type=int, default=4, help="Measured turns per session and phase.")
    p.add_argument("--think-s", default="1,3", help="Tool pause between turns: uniform lo,hi.")
    p.add_argument("--context-tokens", type=int, default=7800)
    p.add_argument("--tool-tokens", type=int, default=120, help="Tool output per turn.")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--vllm-router",
        default=os.environ.get("VLLM_ROUTER_BIN", "/tmp/vr-venv/bin/vllm-router"),
        help="vllm-router executable (its own venv).",
    )
    p.add_argument("--no-vllm-router", action="store_true")
    p.add_argument(
        "--granian",
        default=os.environ.get("GRANIAN_PATH", "/tmp/granian-pkgs"),
        help="A folder holding the granian package (`pip install --target DIR granian`) for "
        "the appliance-granian path: the appliance's API served by granian.",
    )
    p.add_argument("--vllm-router-policy", default="cache_aware", help="Its --policy.")
    p.add_argument("--target-ms", default="1,5", help="Target added p50,p99 in ms.")
    p.add_argument(
        "--py-spy",
        default=None,
        help="py-spy executable: profile the appliance process (collapsed stacks written "
        "next to --out as *.appliance.folded).",
    )
    p.add_argument(
        "--cprofile", type=Path, default=None, help="Run the appliance under cProfile, to FILE."
    )
    p.add_argument("--keep-logs", type=Path, default=None, help="Copy the process logs here.")
    p.add_argument(
        "--router-cpus",
        default=None,
        help="CPUs for the routers alone (e.g. 1): the appliance and vllm-router run there, "
        "the client and the workers on the others, as a router on cores of its own would.",
    )
    p.add_argument(
        "--serve-worker", nargs=3, metavar=("PORT", "KV", "MAXLEN"), help=argparse.SUPPRESS
    )
    p.add_argument("--serve-relay", nargs=4, type=int, help=argparse.SUPPRESS)
    p.add_argument("--serve-http-relay", nargs=4, type=int, help=argparse.SUPPRESS)
    p.add_argument("--serve-appliance-granian", action="store_true", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    if rest and not args.serve_appliance_granian:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    args.up_args = rest
    args.think_s = tuple(float(x) for x in args.think_s.split(","))
    args.target_ms = tuple(float(x) for x in args.target_ms.split(","))
    args.router_cpus = {int(c) for c in args.router_cpus.split(",")} if args.router_cpus else None
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.serve_worker:
        port, kv, max_len = args.serve_worker
        serve_worker(int(port), kv, int(max_len))
        return
    if args.serve_relay:
        serve_relay(args.serve_relay[:2], args.serve_relay[2:])
        return
    if args.serve_http_relay:
        serve_http_relay(args.serve_http_relay[:2], args.serve_http_relay[2:])
        return
    if args.serve_appliance_granian:
        serve_appliance_granian(args.granian, args.up_args)
        return
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
    paths = args.paths.split(",")
    vr_bin = None if args.no_vllm_router else shutil.which(args.vllm_router)
    if "appliance-granian" in paths and not granian_found(args.granian):
        print(f"granian not found in {args.granian}; the appliance-granian rows are left out")
        paths.remove("appliance-granian")
    if vr_bin is None and "vllm-router" in paths:
        print(f"vllm-router not found at {args.vllm_router}; its rows are left out", flush=True)
        paths.remove("vllm-router")
    if args.router_cpus:  # the client and the workers it starts keep to the other CPUs
        others = os.sched_getaffinity(0) - args.router_cpus
        if not others:
            raise SystemExit(f"--router-cpus {sorted(args.router_cpus)} leaves no CPU for the rest")
        os.sched_setaffinity(0, others)
    t_start = time.monotonic()
    # On a quiet machine, before anything starts: how much of a router's time here is the
    # cost of running cold (benchmarks/cold_path.py).
    cold = cold_path.measure()
    print(f"cold path (median us per call, x: times the hot figure):\n{cold_path.table(cold)}\n")
    tmp = Path(tempfile.mkdtemp(prefix="router-overhead-"))
    procs = Procs(tmp)
    try:
        figures = asyncio.run(run(args, tmp, procs, concurrencies, modes, paths, vr_bin))
    finally:
        procs.stop()
        if args.keep_logs:
            shutil.copytree(tmp, args.keep_logs, dirs_exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    figures["cold_path_us"] = cold
    figures["run_s"] = round(time.monotonic() - t_start, 1)
    rows = figures["rows"]
    print()
    print(table(rows, args.target_ms))
    print(
        f"\n(ms; overhead = client time - worker time per request; added = overhead minus the "
        f"direct path's, same percentile; first byte diff = plain difference of client-side "
        f"percentiles; target: added p50 <= {args.target_ms[0]:g} ms, p99 <= "
        f"{args.target_ms[1]:g} ms; run {figures['run_s']} s)"
    )
    args.out.write_text(json.dumps(figures, indent=2))
    print(f"JSON: {args.out}")


async def run(
    args: argparse.Namespace,
    tmp: Path,
    procs: Procs,
    concurrencies: list[int],
    modes: list[str],
    paths: list[str],
    vr_bin: str | None,
) -> dict[str, Any]:
    w_ports = free_ports(2)
    kv_ports = free_ports(2)
    app_port, vr_port, vr_prom, *relay_ports = free_ports(5)
    http_relay_ports = free_ports(2)
    (granian_port,) = free_ports(1)
    app_ports = {"appliance": app_port, "appliance-granian": granian_port}
    worker_urls = [f"http://127.0.0.1:{p}" for p in w_ports]
    max_len = 32768
    for i, (port, kv) in enumerate(zip(w_ports, kv_ports, strict=True)):
        procs.start(
            f"worker{i}",
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--serve-worker",
                str(port),
                f"tcp://*:{kv}",
                str(max_len),
            ],
        )
    for url in worker_urls:
        wait_http(f"{url}/health", procs)
    data_dir = tmp / "data"
    data_dir.mkdir()
    key = add_key(data_dir, TENANT)
    # One secret for both appliances (own server, granian): the same tenant salt, so the
    # workers see the same block hashes from either, and the direct path's as well.
    (data_dir / "secret.key").write_text(os.urandom(32).hex())
    (data_dir / "secret.key").chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    env.update(
        APPLIANCE_DATA_DIR=str(data_dir),
        APPLIANCE_ENGINE__EXTERNAL_URLS=json.dumps(worker_urls),
        APPLIANCE_ENGINE__EXTERNAL_KV_EVENT_ENDPOINTS=json.dumps(
            [f"tcp://*:{kv}" for kv in kv_ports]
        ),
        APPLIANCE_ENGINE__MAX_MODEL_LEN=str(max_len),
        # The workers run as `appliance up` runs them, keeping idle connections 300 s.
        APPLIANCE_ENGINE__EXTERNAL_KEEPALIVE_S=str(WORKER_KEEPALIVE_S),
    )
    if "appliance" in paths:
        up = ["up", "--engine", "external", "--port", str(app_port)]
        if args.cprofile:  # the main thread only: the event loop
            argv = [sys.executable, "-m", "cProfile", "-o", str(args.cprofile.resolve())]
            argv += ["-m", "cli.main", *up]
        else:
            argv = [str(BIN / "appliance"), *up]
        procs.start("appliance", argv, env=env, cpus=args.router_cpus)
        wait_http(f"http://127.0.0.1:{app_port}/health", procs)
        if args.py_spy:
            folded = args.out.with_suffix(".appliance.folded").resolve()
            procs.start(
                "py-spy",
                [
                    args.py_spy,
                    "record",
                    "--nonblocking",
                    "--gil",
                    "--threads",
                    "--format",
                    "raw",
                    "--rate",
                    "250",
                    "-o",
                    str(folded),
                    "-p",
                    str(procs.procs["appliance"].pid),
                ],
            )
    if "appliance-granian" in paths:
        granian_dir = tmp / "data-granian"  # a data dir is locked by the appliance using it
        granian_dir.mkdir()
        for name in (KEYS_FILE, "secret.key"):
            shutil.copy2(data_dir / name, granian_dir / name)
        procs.start(
            "appliance-granian",
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--granian",
                args.granian,
                "--serve-appliance-granian",
                "--engine",
                "external",
                "--port",
                str(granian_port),
            ],
            env={**env, "APPLIANCE_DATA_DIR": str(granian_dir)},
            cpus=args.router_cpus,
        )
        wait_http(f"http://127.0.0.1:{granian_port}/health", procs)
    relays = (
        ("tcp-relay", "--serve-relay", relay_ports),
        ("http-relay", "--serve-http-relay", http_relay_ports),
    )
    for name, flag, ports in relays:
        if name not in paths:
            continue
        procs.start(
            name,
            [
                sys.executable,
                str(Path(__file__).resolve()),
                flag,
                *map(str, ports),
                *map(str, w_ports),
            ],
            cpus=args.router_cpus,
        )
        for port in ports:
            wait_http(f"http://127.0.0.1:{port}/health", procs)
    vr_version = None
    if "vllm-router" in paths and vr_bin:
        procs.start(
            "vllm-router",
            [
                vr_bin,
                "--worker-urls",
                *worker_urls,
                "--host",
                "127.0.0.1",
                "--port",
                str(vr_port),
                "--prometheus-port",
                str(vr_prom),
                "--log-level",
                "warning",
                "--policy",
                args.vllm_router_policy,
            ],
            cpus=args.router_cpus,
        )
        wait_http(f"http://127.0.0.1:{vr_port}/health", procs)
        vr_version = _vr_version(vr_bin)
    salt = tenant_salt(data_dir) if (data_dir / "secret.key").exists() else None

    n_sessions = max(concurrencies)
    rng = random.Random(7)
    contexts = [words(rng, args.context_tokens - 20) for _ in range(n_sessions)]
    placement: dict[int, int] = {}

    def salted(sid: str) -> dict[str, Any]:
        extra: dict[str, Any] = {"session_id": f"{TENANT}/{sid}"}
        if salt:
            extra["cache_salt"] = salt
        return extra

    all_paths = {
        "direct": TrafficPath(
            "direct",
            lambda i: worker_urls[placement.get(i, i % 2)],
            lambda sid: {},
            salted,
            None,
        ),
        "tcp-relay": TrafficPath(
            "tcp-relay",
            lambda i: f"http://127.0.0.1:{relay_ports[placement.get(i, i % 2)]}",
            lambda sid: {},
            salted,
            "tcp-relay",
        ),
        "http-relay": TrafficPath(
            "http-relay",
            lambda i: f"http://127.0.0.1:{http_relay_ports[placement.get(i, i % 2)]}",
            lambda sid: {},
            salted,
            "http-relay",
        ),
        "appliance": TrafficPath(
            "appliance",
            lambda i: f"http://127.0.0.1:{app_port}",
            lambda sid: {"authorization": f"Bearer {key}", "x-session-id": sid, "x-task-id": sid},
            lambda sid: {},
            "appliance",
        ),
        "appliance-granian": TrafficPath(
            "appliance-granian",
            lambda i: f"http://127.0.0.1:{granian_port}",
            lambda sid: {"authorization": f"Bearer {key}", "x-session-id": sid, "x-task-id": sid},
            lambda sid: {},
            "appliance-granian",
        ),
        "vllm-router": TrafficPath(
            "vllm-router",
            lambda i: f"http://127.0.0.1:{vr_port}",
            lambda sid: {},
            salted,
            "vllm-router",
        ),
    }
    # Warm-up: through vllm-router when it runs (its prefix tree learns where each
    # context is; the appliance learns the same from KV events), else through the
    # appliance; the direct path then sends each session where its context lives.
    warm_path = "vllm-router" if "vllm-router" in paths else paths[-1]
    warm_target = all_paths[warm_path]
    t = time.monotonic()
    print(f"warm-up: {n_sessions} contexts through {warm_path} ...", flush=True)
    rids = await warm_up(warm_target, contexts, width=16)
    stamps = await collect(worker_urls)
    for i, rid in rids.items():
        if rid in stamps:
            placement[i] = int(stamps[rid][0][1:])
    print(
        f"warm-up: {time.monotonic() - t:.1f} s; contexts per worker: "
        f"{[list(placement.values()).count(w) for w in range(2)]}",
        flush=True,
    )
    for name in ("appliance", "appliance-granian"):
        if warm_path != name and name in paths:
            # The appliance has seen each context once too, as vllm-router has: its
            # tokenizer's piece cache and its hash chains are as warm as vllm-router's
            # prefix tree.
            await warm_up(all_paths[name], contexts, width=16)
    rows = []
    phase_no = 0
    for conc in concurrencies:
        for mode in modes:
            for name in paths:
                phase_no += 1
                path = all_paths[name]
                cpu = (lambda p=path.process: procs.cpu_s(p)) if path.process else None
                t = time.monotonic()
                metrics_url = f"http://127.0.0.1:{app_ports.get(name, app_port)}/metrics"
                own0 = forward_histogram(metrics_url) if name in app_ports else None
                phase = await run_phase(
                    path, contexts, conc, mode, args, phase_no, cpu, procs.all_cpu_s
                )
                stamps = await collect(worker_urls)
                row = summarise(phase, stamps)
                if own0 is not None:
                    row["appliance_forward_ms"] = forward_summary(
                        own0, forward_histogram(metrics_url)
                    )
                    row["appliance_prefill_slowdown"] = prefill_slowdowns(metrics_url)
                rows.append(row)
                o = row["overhead_first_ms"]
                print(
                    f"{name:12s} sessions={conc:<4d} {mode:9s} n={row['requests']:<5d} "
                    f"err={row['errors']} overhead p50={o['p50']:.2f} p99={o['p99']:.2f} ms "
                    f"first byte p50={row['first_byte_ms']['p50']:.1f} ms "
                    f"hit={row['cache_hit']} busy={row['machine_busy']} "
                    f"cpu/req={row['cpu_ms_per_request']} ({time.monotonic() - t:.1f} s)"
                    + (
                        f" own={row['appliance_forward_ms']} "
                        f"slowdown={row['appliance_prefill_slowdown']}"
                        if own0 is not None
                        else ""
                    ),
                    flush=True,
                )
                procs.check()
    add_differences(rows)
    return {
        "config": {
            "concurrency": concurrencies,
            "modes": modes,
            "paths": paths,
            "turns": args.turns,
            "think_s": list(args.think_s),
            "context_tokens": args.context_tokens,
            "tool_tokens": args.tool_tokens,
            "max_tokens": args.max_tokens,
            "target_ms": list(args.target_ms),
            "vllm_router": {
                "bin": vr_bin,
                "version": vr_version,
                "policy": args.vllm_router_policy,
            },
            "cpus": os.cpu_count(),
            "router_cpus": sorted(args.router_cpus) if args.router_cpus else None,
        },
        "rows": rows,
    }


def _vr_version(vr_bin: str) -> str | None:
    pip = Path(vr_bin).parent / "pip"
    try:
        out = subprocess.run(
            [str(pip), "show", "vllm-router"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return None


if __name__ == "__main__":
    main()
