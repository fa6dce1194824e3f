"""The supervisor's mechanics against a stand-in worker, in seconds: restarts with backoff,
giving up, start failures, drain, SIGTERM/SIGKILL escalation and the appliance dying.

The stand-in is a small HTTP server run by the supervisor exactly as vLLM is (same argv,
trampoline, process group); like vLLM it has a child process (the "engine core") and on
SIGTERM stops it and exits. The same behaviours against real vLLM are in
test_supervisor_vllm.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import psutil
import pytest

from appliance.domain.worker import WorkerEvent, WorkerEventKind, WorkerState
from appliance.engines.errors import WorkerStartFailed
from appliance.engines.supervision.launch import Device, LaunchSpec
from appliance.engines.supervision.supervisor import Supervisor, SupervisorTimings
from appliance.engines.supervision.worker_process import group_alive, process_running
from tests.ports import free_port_block
from tests.processes import live_children_since

FAKE_WORKER = r"""
import argparse, http.server, json, os, signal, subprocess, sys, threading, time
p = argparse.ArgumentParser()
p.add_argument("--port", type=int)
p.add_argument("--host")
args, _ = p.parse_known_args()
mode = os.environ.get("FAKE_MODE", "")
marker = os.environ.get("FAKE_MARKER")
print("INFO starting fake engine", flush=True)
if mode == "fail" or (marker and os.path.exists(marker)):
    print("ValueError: boom: the fake engine cannot start", file=sys.stderr, flush=True)
    sys.exit(3)
if marker:
    open(marker, "w").close()
core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
state = {"running": 0, "sick": False}
lock = threading.Lock()

def on_term(*_):
    # A dying appliance may send SIGTERM once per thread of it (PR_SET_PDEATHSIG fires as
    # the children are handed from thread to thread): handle the first only.
    if mode != "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        core.terminate()
        core.wait()
        os._exit(0)

signal.signal(signal.SIGTERM, on_term)

class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def reply(self, code, body=b""):
        self.send_response(code)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self.reply(503 if state["sick"] else 200)
        elif self.path == "/metrics":
            line = 'vllm:num_requests_running{engine="0",model_name="m"} %d\n' % state["running"]
            self.reply(200, line.encode())
        else:
            self.reply(404)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.path == "/sick":
            state["sick"] = True
            return self.reply(200, b"{}")
        with lock:
            state["running"] += 1
        time.sleep(req.get("sleep_s", 0))
        with lock:
            state["running"] -= 1
        self.reply(200, json.dumps({"done": True, "pid": os.getpid()}).encode())

time.sleep(float(os.environ.get("FAKE_START_S", "0.2")))
http.server.ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
"""

FAST = SupervisorTimings(
    startup_timeout_s=20,
    health_interval_s=0.1,
    health_timeout_s=1,
    unhealthy_restart_s=0.5,
    restart_base_s=0.05,
    restart_cap_s=0.2,
    max_restarts_in_a_row=2,
    drain_deadline_s=10,
    term_grace_s=2,
    poll_s=0.05,
)
_TEST_START = [0.0]


@pytest.fixture(autouse=True)
def _note_test_start() -> None:
    _TEST_START[0] = time.time()


@pytest.fixture
def spec(tmp_path: Path) -> LaunchSpec:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    return LaunchSpec(
        model=str(model),
        served_model_name="m",
        python=sys.executable,
        device=Device.CPU,
        workers=2,
        base_port=free_port_block(2),
        kv_events_base_port=free_port_block(2),
        block_size=32,
        cpu_ids=tuple(sorted(os.sched_getaffinity(0))),
        entrypoint=(str(script),),
    )


async def wait_for(predicate, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def kinds(events: list[WorkerEvent], worker: str) -> list[WorkerEventKind]:
    return [e.kind for e in events if e.worker == worker]


def assert_no_process_left(sup: Supervisor, groups: set[int]) -> None:
    assert sup.process_groups() == frozenset()
    for pgid in groups:
        assert not group_alive(pgid), f"process group {pgid} survived"
    assert not live_children_since(_TEST_START[0])


def test_killed_worker_is_restarted_with_backoff_and_reported(spec, tmp_path) -> None:
    events: list[WorkerEvent] = []
    resets: list[tuple[str, str]] = []

    async def go() -> set[int]:
        sup = Supervisor(
            spec,
            log_dir=tmp_path / "logs",
            on_event=events.append,
            on_kv_reset=lambda w, why: resets.append((w, why)),
            timings=FAST,
        )
        async with sup:
            w0, w1 = sup.workers
            assert (w0.state, w1.state) == (WorkerState.HEALTHY, WorkerState.HEALTHY)
            old = w1.pid
            assert old is not None
            groups = set(sup.process_groups())
            os.kill(old, signal.SIGKILL)
            await wait_for(lambda: w1.restarts == 1 and w1.state == WorkerState.HEALTHY)
            assert w1.pid != old and not group_alive(old)  # the old "engine core" went too
            assert w0.restarts == 0 and w0.healthy
            assert (await w1.client.completions({}))["pid"] == w1.pid
            groups |= sup.process_groups()
        return groups

    groups = asyncio.run(go())
    assert kinds(events, "w1") == [
        WorkerEventKind.STARTED,
        WorkerEventKind.HEALTHY,
        WorkerEventKind.EXITED,
        WorkerEventKind.RESTART_SCHEDULED,
        WorkerEventKind.STARTED,
        WorkerEventKind.HEALTHY,
        WorkerEventKind.DRAINING,
        WorkerEventKind.STOPPED,
    ]
    exited = next(e for e in events if e.kind == WorkerEventKind.EXITED)
    assert exited.exit_code == -signal.SIGKILL and exited.state == WorkerState.EXITED
    scheduled = next(e for e in events if e.kind == WorkerEventKind.RESTART_SCHEDULED)
    assert scheduled.backoff_s == FAST.restart_base_s
    restarted = [e for e in events if e.worker == "w1" and e.kind == WorkerEventKind.STARTED]
    assert [e.restarts for e in restarted] == [0, 1]
    assert resets == [("w1", "worker exited with code -9")]
    assert_no_process_left_after(groups)


def assert_no_process_left_after(groups: set[int]) -> None:
    for pgid in groups:
        assert not group_alive(pgid), f"process group {pgid} survived"
    assert not live_children_since(_TEST_START[0])


def test_gives_up_after_failed_starts_in_a_row(spec, tmp_path) -> None:
    """w0 starts once; every restart fails; after max_restarts_in_a_row it stays FAILED."""
    events: list[WorkerEvent] = []
    spec = replace(spec, workers=1, extra_env={"FAKE_MARKER": str(tmp_path / "started")})

    async def go() -> None:
        async with Supervisor(
            spec, log_dir=tmp_path / "logs", on_event=events.append, timings=FAST
        ) as sup:
            (w0,) = sup.workers
            assert w0.pid is not None
            os.kill(w0.pid, signal.SIGKILL)
            await wait_for(lambda: w0.state == WorkerState.FAILED)
            assert not w0.accepts_requests

    asyncio.run(go())
    assert kinds(events, "w0")[2:] == [
        WorkerEventKind.EXITED,
        WorkerEventKind.RESTART_SCHEDULED,
        WorkerEventKind.STARTED,
        WorkerEventKind.EXITED,
        WorkerEventKind.RESTART_SCHEDULED,
        WorkerEventKind.STARTED,
        WorkerEventKind.EXITED,
        WorkerEventKind.GAVE_UP,
        WorkerEventKind.STOPPED,
    ]
    backoffs = [e.backoff_s for e in events if e.kind == WorkerEventKind.RESTART_SCHEDULED]
    assert backoffs == [0.05, 0.1]
    last_exit = [e for e in events if e.kind == WorkerEventKind.EXITED][-1]
    assert last_exit.exit_code == 3
    assert last_exit.detail == "ValueError: boom: the fake engine cannot start"
    assert_no_process_left_after(set())


def test_failed_start_names_the_cause_and_leaves_nothing(spec, tmp_path) -> None:
    sup = Supervisor(
        replace(spec, extra_env={"FAKE_MODE": "fail"}), log_dir=tmp_path / "logs", timings=FAST
    )
    with pytest.raises(WorkerStartFailed) as err:
        asyncio.run(sup.start())
    # Both fail; the first one seen is reported and the other is stopped with it.
    match = re.fullmatch(
        r"worker (w[01]) exited with code 3 during startup: "
        r"ValueError: boom: the fake engine cannot start \(log: (.*)\)",
        err.value.message,
    )
    assert match is not None, err.value.message
    assert match.group(2) == str(tmp_path / "logs" / f"{match.group(1)}.log")
    assert all(w.state == WorkerState.STOPPED for w in sup.workers)
    assert_no_process_left(sup, set())


def test_drain_lets_running_requests_finish(spec, tmp_path) -> None:
    events: list[WorkerEvent] = []

    async def go() -> tuple[dict, float, set[int]]:
        sup = Supervisor(spec, log_dir=tmp_path / "logs", on_event=events.append, timings=FAST)
        await sup.start()
        groups = set(sup.process_groups())
        w0 = sup.workers[0]
        request = asyncio.create_task(w0.client.completions({"sleep_s": 1.5}))
        await wait_for(lambda: w0.load is not None and w0.load.running == 1)
        started = time.monotonic()
        stopping = asyncio.create_task(sup.stop())
        await wait_for(lambda: sup.draining and all(w.draining for w in sup.workers))
        assert not w0.accepts_requests
        reply = await request
        await stopping
        return reply, time.monotonic() - started, groups

    reply, took_s, groups = asyncio.run(go())
    assert reply["done"]
    assert 1.0 < took_s < 5.0
    assert_no_process_left_after(groups)
    draining = [e for e in events if e.kind == WorkerEventKind.DRAINING]
    assert len(draining) == 2


def test_drain_deadline_then_sigkill_when_sigterm_is_ignored(spec, tmp_path) -> None:
    timings = replace(FAST, term_grace_s=0.5)
    spec = replace(spec, workers=1, extra_env={"FAKE_MODE": "ignore-term"})

    async def go() -> tuple[float, set[int]]:
        sup = Supervisor(spec, log_dir=tmp_path / "logs", timings=timings)
        await sup.start()
        groups = set(sup.process_groups())
        w0 = sup.workers[0]
        request = asyncio.create_task(w0.client.completions({"sleep_s": 60}))
        await wait_for(lambda: w0.load is not None and w0.load.running == 1)
        started = time.monotonic()
        await sup.stop(drain_deadline_s=0.5)
        request.cancel()
        return time.monotonic() - started, groups

    took_s, groups = asyncio.run(go())
    assert took_s < 8.0
    assert_no_process_left_after(groups)


def test_unresponsive_worker_is_marked_then_restarted(spec, tmp_path) -> None:
    events: list[WorkerEvent] = []
    spec = replace(spec, workers=1)

    async def go() -> None:
        async with Supervisor(
            spec, log_dir=tmp_path / "logs", on_event=events.append, timings=FAST
        ) as sup:
            (w0,) = sup.workers
            async with httpx.AsyncClient() as http:
                await http.post(w0.client.base_url + "/sick", json={})
            await wait_for(lambda: w0.state == WorkerState.UNHEALTHY)
            assert not w0.accepts_requests
            await wait_for(lambda: w0.restarts == 1 and w0.healthy)

    asyncio.run(go())
    assert kinds(events, "w0")[2:6] == [
        WorkerEventKind.UNHEALTHY,
        WorkerEventKind.EXITED,
        WorkerEventKind.RESTART_SCHEDULED,
        WorkerEventKind.STARTED,
    ]


APPLIANCE = """
import asyncio, json, sys
from pathlib import Path
from appliance.engines.supervision.launch import LaunchSpec, Device
from appliance.engines.supervision.supervisor import Supervisor

async def main():
    spec = LaunchSpec(**json.loads(sys.argv[1]))
    sup = Supervisor(spec, log_dir=Path(sys.argv[2]))
    await sup.start()
    pids = [w.pid for w in sup.workers]
    print(json.dumps(pids), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_workers_die_with_a_killed_appliance(spec, tmp_path) -> None:
    """SIGKILL gives the appliance no chance to clean up: the kernel SIGTERMs the workers."""
    fields = {
        "model": spec.model,
        "served_model_name": "m",
        "python": sys.executable,
        "device": "cpu",
        "workers": 2,
        "base_port": spec.base_port,
        "kv_events_base_port": spec.kv_events_base_port,
        "block_size": 32,
        "entrypoint": list(spec.entrypoint),
    }
    appliance = subprocess.Popen(
        [sys.executable, "-c", APPLIANCE, json.dumps(fields), str(tmp_path / "logs")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    try:
        assert appliance.stdout is not None
        pids = json.loads(appliance.stdout.readline())
        workers = [psutil.Process(pid) for pid in pids]
        cores = [c for w in workers for c in w.children()]
        assert len(cores) == 2
        appliance.kill()
        appliance.wait(10)
        procs = [*workers, *cores]
        deadline = time.monotonic() + 15
        while any(process_running(p.pid) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = [(p.pid, p.status()) for p in procs if process_running(p.pid)]
        assert not alive, f"left running: {alive}"
    finally:
        if appliance.poll() is None:
            appliance.kill()
        for pid in locals().get("pids", ()):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # cleanup only: the assertion is above
