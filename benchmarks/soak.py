"""Soak: many concurrent agent sessions against `appliance up --engine sim` for minutes,
watching the error rate, the latency and whether the appliance's memory stays flat.

    PYTHONPATH=. .venv/bin/python benchmarks/soak.py [--sessions 400] [--duration 600]
        [--warmup 60] [--out soak.json] [--turns 10] [--think-s 0.5,2]
        [--context-words 600] [--tool-words 60] [--max-tokens 32] [--sample-s 5]
        [--keep DIR]

One run starts `appliance up --engine sim --workers 2` (default settings otherwise, a fresh
data dir under /tmp, free local ports), adds one API key, and runs `--sessions` agent
sessions at once for `--duration` seconds. Each session is a loop of tasks: a new task (its
X-Task-ID, also its X-Session-ID unless `--one-session`, where an agent keeps one session id
across its tasks) with a system prompt of its own (`--context-words` random words, so every
task prefills new context), then `--turns` streamed chat turns, each
re-sending the whole chat so far plus a new tool output (`--tool-words`) and asking for
`--max-tokens` tokens, with a uniform `--think-s` pause (the tool running) between turns;
then a `succeeded` event closes the task and the next one begins. Sessions start spread
over the first `2 x think` seconds. Each session has its own kept-alive connection, as
separate agents have, on the appliance's own HTTP/1.1 client (appliance/engines/clients/http1.py:
the lightest client here; this machine's 2 cores run the client, the appliance and both
simulated workers). After `--duration` no new turn starts; turns in flight finish (at most
`--drain` seconds).

Recorded per turn: its start, status, time to the first body byte of the streamed answer
(TTFT: the simulated worker sends its first chunk with the first token) and to its end
(e2e). A turn is an error when the status is not 200, the stream ends without
`data: [DONE]` or carries an error event, or the connection fails or times out; errors are
counted by kind. Every `--sample-s` seconds: the resident set (RSS) of the appliance's
process (its own, not its workers'), the workers' total, the CPU seconds of each and of
this client, the client event loop's lag, the ledger's size on disk and the sessions the
router holds (its `appliance_sessions` gauge).

Reported (JSON to `--out`, a summary on stdout): turns, the achieved turn rate against the
rate the sessions would offer if every turn took no time (sessions / mean pause), error
rate and kinds, TTFT and e2e p50/p99 over the turns that started after `--warmup`, and the
appliance's RSS at the end of the warm-up ("start"), the middle of the rest of the run and
its end, with `rss_flat`: whether the end is within 10 % of the start. Client saturation:
the client's share of one core and its event loop's lag (p99, max) — when the client is
busy, turns start later than their pauses say and the achieved rate falls below the offered
one for that reason, not the appliance's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance import eventloop  # noqa: E402
from appliance.config.keystore import add_key, keys_path  # noqa: E402
from appliance.engines.clients.http1 import Http1Error, Http1Pool  # noqa: E402
from tests.running import appliance_process  # noqa: E402
from tests.words import numbered_words as words  # noqa: E402

STARTUP_S = 180.0
WORKERS = 2
_CONTENT = re.compile(rb'"content"\s*:\s*"[^"]')
_ERROR_CODE = re.compile(rb'"code"\s*:\s*"([^"]+)"')
_SESSIONS = re.compile(rb"^appliance_sessions (\S+)", re.M)
TRACE_BOOT = """
import os, runpy, signal, sys, tracemalloc
count = [0]
def dump(*_):
    count[0] += 1
    path = f"{os.environ['SOAK_TRACE']}.{count[0]}"
    tracemalloc.take_snapshot().dump(path + ".part")
    os.replace(path + ".part", path)
signal.signal(signal.SIGUSR1, dump)
sys.argv = ["appliance", *sys.argv[1:]]
runpy.run_module("cli.main", run_name="__main__")
"""
"""`--trace-memory`: the appliance under tracemalloc, a snapshot written on each SIGUSR1."""
FLAT_SHARE = 0.10
"""The end RSS within this share of the start RSS counts as flat."""


@dataclass
class Up:
    url: str
    port: int
    key: str
    data_dir: Path
    proc: subprocess.Popen[bytes]


@contextmanager
def appliance_up(data_dir: Path, trace: Path | None = None) -> Iterator[Up]:
    """`appliance up --engine sim --workers 2` until the block ends (SIGTERM, as Ctrl-C)."""
    key = add_key(keys_path(data_dir), "soak").key
    program: list[str] = []
    env: dict[str, str] = {}
    if trace is not None:  # 5 frames a trace: enough to tell whose allocation it is
        program = [sys.executable, "-X", "tracemalloc=5", "-c", TRACE_BOOT]
        env["SOAK_TRACE"] = str(trace)
    with appliance_process(
        data_dir, workers=WORKERS, env=env, startup_s=STARTUP_S, program=program, stop_s=90
    ) as up:
        yield Up(up.url, up.ports[0], key, data_dir, up.proc)


# --- the load -------------------------------------------------------------------------------


@dataclass
class Turn:
    at: float
    """Seconds from the run's start at which the turn was sent."""
    ok: bool
    status: int
    ttft_s: float | None
    e2e_s: float
    error: str | None = None


@dataclass
class Sample:
    at: float
    appliance_rss: int
    workers_rss: int
    appliance_cpu_s: float
    workers_cpu_s: float
    client_cpu_s: float
    machine_busy: float
    ledger_bytes: int
    turns: int
    in_flight: int
    lag_p99_ms: float
    lag_max_ms: float
    sessions_held: int | None
    """The router's `appliance_sessions` gauge (sessions it holds state for)."""


@dataclass
class Run:
    args: argparse.Namespace
    up: Up
    t0: float = 0.0
    stop_at: float = 0.0
    turns: list[Turn] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    events_failed: Counter[str] = field(default_factory=Counter)
    tasks_closed: int = 0
    in_flight: int = 0
    lags: list[float] = field(default_factory=list)


async def one_turn(
    run: Run, pool: Http1Pool, sid: str, tid: str, messages: list[dict[str, str]]
) -> tuple[Turn, str]:
    body = {
        "model": "sim",
        "messages": messages,
        "max_tokens": run.args.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = (
        ("Authorization", f"Bearer {run.up.key}"),
        ("Content-Type", "application/json"),
        ("X-Session-ID", sid),
        ("X-Task-ID", tid),
    )
    raw = json.dumps(body).encode()
    start = time.monotonic()
    at = start - run.t0
    ttft: float | None = None
    parts: list[bytes] = []
    run.in_flight += 1
    try:
        async with asyncio.timeout(run.args.turn_timeout_s):
            answer = await pool.request("POST", "/v1/chat/completions", raw, headers)
            async for chunk in answer.chunks():
                if ttft is None and _CONTENT.search(chunk):
                    ttft = time.monotonic() - start
                parts.append(chunk)
    except (Http1Error, OSError, TimeoutError) as exc:
        kind = "timeout" if isinstance(exc, TimeoutError) else f"connection: {exc}"[:80]
        return Turn(at, False, 0, ttft, time.monotonic() - start, kind), ""
    finally:
        run.in_flight -= 1
    e2e = time.monotonic() - start
    text = b"".join(parts)
    if answer.status != 200:
        code = _ERROR_CODE.search(text)
        kind = f"{answer.status} {code.group(1).decode() if code else ''}".strip()
        return Turn(at, False, answer.status, None, e2e, kind), ""
    if not text.rstrip().endswith(b"data: [DONE]"):
        return Turn(at, False, 200, ttft, e2e, "stream cut"), ""
    content: list[str] = []
    for line in text.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            return Turn(at, False, 200, ttft, e2e, "stream error event"), ""
        for choice in chunk.get("choices") or ():
            content.append((choice.get("delta") or {}).get("content") or "")
    return Turn(at, True, 200, ttft, e2e), "".join(content)


async def close_task(run: Run, pool: Http1Pool, tid: str) -> None:
    headers = (
        ("Authorization", f"Bearer {run.up.key}"),
        ("Content-Type", "application/json"),
    )
    try:
        async with asyncio.timeout(30):
            answer = await pool.request(
                "POST", f"/v1/tasks/{tid}/events", b'{"type": "succeeded"}', headers
            )
            await answer.read()
    except (Http1Error, OSError, TimeoutError) as exc:
        run.events_failed[type(exc).__name__] += 1
        return
    if answer.status >= 300:
        run.events_failed[str(answer.status)] += 1
    else:
        run.tasks_closed += 1


async def session(run: Run, i: int, tag: str) -> None:
    args = run.args
    lo, hi = args.think_s
    rng = random.Random(f"soak-{i}")
    pool = Http1Pool(
        "127.0.0.1",
        run.up.port,
        connect_timeout_s=10,
        read_timeout_s=args.turn_timeout_s,
        keepalive_s=60,
        max_idle=1,
    )
    try:
        await asyncio.sleep(rng.uniform(0, 2 * hi))
        task = 0
        while time.monotonic() < run.stop_at:
            tid = f"{tag}-s{i}-t{task}"
            sid = f"{tag}-s{i}" if args.one_session else tid
            task += 1
            messages = [{"role": "system", "content": words(rng, args.context_words)}]
            for turn in range(args.turns):
                if time.monotonic() >= run.stop_at:
                    break
                messages.append({"role": "user", "content": words(rng, args.tool_words)})
                result, content = await one_turn(run, pool, sid, tid, messages)
                run.turns.append(result)
                messages.append({"role": "assistant", "content": content})
                if turn + 1 < args.turns:
                    await asyncio.sleep(rng.uniform(lo, hi))
            await close_task(run, pool, tid)
    finally:
        pool.close()


async def lag_ticker(run: Run, every_s: float = 0.05) -> None:
    """How late the client's event loop wakes up: its own saturation."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(every_s)
        run.lags.append(max(0.0, loop.time() - t - every_s))


def _rss_cpu(procs: list[psutil.Process]) -> tuple[int, float]:
    rss, cpu = 0, 0.0
    for p in procs:
        try:
            rss += p.memory_info().rss
            t = p.cpu_times()
            cpu += t.user + t.system
        except psutil.Error:
            pass
    return rss, cpu


async def sessions_held(pool: Http1Pool) -> int | None:
    try:
        async with asyncio.timeout(10):
            answer = await pool.request("GET", "/metrics")
            text = await answer.read()
    except (Http1Error, OSError, TimeoutError):
        return None
    found = _SESSIONS.search(text)
    return int(float(found.group(1))) if found else None


async def sampler(run: Run) -> None:
    pool = Http1Pool(
        "127.0.0.1", run.up.port, connect_timeout_s=10, read_timeout_s=10, keepalive_s=60
    )
    me = psutil.Process()
    app = psutil.Process(run.up.proc.pid)
    machine0 = psutil.cpu_times()
    while True:
        children = app.children(recursive=True)
        app_rss, app_cpu = _rss_cpu([app])
        kids_rss, kids_cpu = _rss_cpu(children)
        machine1 = psutil.cpu_times()
        idle = (machine1.idle + machine1.iowait) - (machine0.idle + machine0.iowait)
        total = sum(machine1) - sum(machine0)
        machine0 = machine1
        lags, run.lags = run.lags, []
        held = await sessions_held(pool)
        ledger = list(run.up.data_dir.glob("ledger.db*"))  # with its -wal and -shm
        run.samples.append(
            Sample(
                at=round(time.monotonic() - run.t0, 2),
                appliance_rss=app_rss,
                workers_rss=kids_rss,
                appliance_cpu_s=round(app_cpu, 2),
                workers_cpu_s=round(kids_cpu, 2),
                client_cpu_s=round(sum(me.cpu_times()[:2]), 2),
                machine_busy=round(1 - idle / total, 3) if total > 0 else 0.0,
                ledger_bytes=sum(_size(p) for p in ledger),
                turns=len(run.turns),
                in_flight=run.in_flight,
                lag_p99_ms=round(_pct(lags, 99) * 1000, 1) if lags else 0.0,
                lag_max_ms=round(max(lags) * 1000, 1) if lags else 0.0,
                sessions_held=held,
            )
        )
        await asyncio.sleep(run.args.sample_s)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # the WAL, checkpointed away since the listing
        return 0


async def drive(run: Run) -> float:
    """The sessions until `--duration`, then the drain; returns the drain's seconds."""
    args = run.args
    tag = f"soak-{secrets.token_hex(3)}"
    run.t0 = time.monotonic()
    run.stop_at = run.t0 + args.duration
    ticker = asyncio.create_task(lag_ticker(run))
    sampling = asyncio.create_task(sampler(run))
    sessions = [asyncio.create_task(session(run, i, tag)) for i in range(args.sessions)]
    last = 0.0
    traced = args.trace_memory is None
    while time.monotonic() < run.stop_at:
        await asyncio.sleep(1.0)
        now = time.monotonic() - run.t0
        if not traced and now >= args.warmup:  # the first snapshot, at the RSS start
            run.up.proc.send_signal(signal.SIGUSR1)
            traced = True
        if now - last >= args.progress_s:
            last = now
            s = run.samples[-1] if run.samples else None
            errors = sum(1 for t in run.turns if not t.ok)
            print(
                f"{now:6.0f} s: {len(run.turns)} turns, {errors} errors, "
                f"in flight {run.in_flight}"
                + (
                    f", appliance RSS {s.appliance_rss / 2**20:.1f} MiB, workers "
                    f"{s.workers_rss / 2**20:.1f} MiB, busy {s.machine_busy:.2f}, "
                    f"client lag p99 {s.lag_p99_ms} ms, sessions held {s.sessions_held}"
                    if s
                    else ""
                ),
                flush=True,
            )
    end_sample = asyncio.create_task(sampler_once(run))
    if args.trace_memory is not None:
        run.up.proc.send_signal(signal.SIGUSR1)
    t_drain = time.monotonic()
    _, pending = await asyncio.wait(sessions, timeout=args.drain)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await end_sample
    drain_s = time.monotonic() - t_drain
    for task in (ticker, sampling):
        task.cancel()
    await asyncio.gather(ticker, sampling, return_exceptions=True)
    return drain_s


async def sampler_once(run: Run) -> None:
    """One more sample at the end of `--duration`, before the drain."""
    task = asyncio.create_task(sampler(run))
    await asyncio.sleep(0.5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# --- the report -----------------------------------------------------------------------------


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _dist(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    return {
        "p50": round(_pct(values, 50), 4),
        "p90": round(_pct(values, 90), 4),
        "p99": round(_pct(values, 99), 4),
        "max": round(max(values), 4),
    }


def _nearest(samples: list[Sample], at: float) -> Sample:
    return min(samples, key=lambda s: abs(s.at - at))


def report(run: Run, drain_s: float, wall_s: float) -> dict[str, Any]:
    args = run.args
    turns = run.turns
    steady = [t for t in turns if t.at >= args.warmup]
    errors = Counter(t.error for t in turns if not t.ok)
    steady_errors = sum(1 for t in steady if not t.ok)
    ok = [t for t in steady if t.ok]
    during = [s for s in run.samples if s.at <= args.duration + 1]
    start = _nearest(during, args.warmup)
    middle = _nearest(during, (args.warmup + args.duration) / 2)
    end = during[-1]
    after = [s for s in during if s.at >= start.at]
    mib = 2**20

    def rss(s: Sample) -> dict[str, Any]:
        return {
            "at_s": s.at,
            "sessions_held": s.sessions_held,
            "appliance_mib": round(s.appliance_rss / mib, 1),
            "workers_mib": round(s.workers_rss / mib, 1),
        }

    growth = (end.appliance_rss - start.appliance_rss) / start.appliance_rss
    slope = _slope([(s.at, s.appliance_rss / mib) for s in after])
    span = max(end.at - start.at, 1e-9)
    steady_s = max(args.duration - args.warmup, 1e-9)
    mean_think = sum(args.think_s) / 2
    client_cpu = (end.client_cpu_s - start.client_cpu_s) / span
    lag_p99 = [s.lag_p99_ms for s in after]
    return {
        "config": {
            "sessions": args.sessions,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "turns_per_task": args.turns,
            "think_s": list(args.think_s),
            "context_words": args.context_words,
            "tool_words": args.tool_words,
            "max_tokens": args.max_tokens,
            "one_session": args.one_session,
            "workers": WORKERS,
            "engine": "sim",
            "cpus": os.cpu_count(),
        },
        "turns": len(turns),
        "turns_after_warmup": len(steady),
        "turn_rate_per_s": round(len(steady) / steady_s, 2),
        "offered_rate_at_zero_latency_per_s": round(args.sessions / mean_think, 2),
        "errors": sum(errors.values()),
        "error_rate": round(sum(errors.values()) / max(len(turns), 1), 5),
        "error_rate_after_warmup": round(steady_errors / max(len(steady), 1), 5),
        "error_kinds": dict(errors.most_common()),
        "tasks_closed": run.tasks_closed,
        "task_events_failed": dict(run.events_failed),
        "ttft_s": _dist([t.ttft_s for t in ok if t.ttft_s is not None]),
        "e2e_s": _dist([t.e2e_s for t in ok]),
        "rss": {
            "start": rss(start),
            "middle": rss(middle),
            "end": rss(end),
            "appliance_max_after_warmup_mib": round(max(s.appliance_rss for s in after) / mib, 1),
            "appliance_growth_start_to_end": round(growth, 4),
            "appliance_slope_mib_per_min": round(slope * 60, 3),
            "rss_flat": abs(growth) <= FLAT_SHARE,
        },
        "cpu_share_of_one_core_after_warmup": {
            "appliance": round((end.appliance_cpu_s - start.appliance_cpu_s) / span, 3),
            "workers": round((end.workers_cpu_s - start.workers_cpu_s) / span, 3),
            "client": round(client_cpu, 3),
        },
        "machine_busy_after_warmup": round(statistics.fmean(s.machine_busy for s in after), 3),
        "client_loop_lag_ms": {
            "p99_median_of_samples": round(statistics.median(lag_p99), 1) if lag_p99 else None,
            "max": max((s.lag_max_ms for s in after), default=None),
        },
        "ledger_mib_end": round(end.ledger_bytes / mib, 1),
        "drain_s": round(drain_s, 1),
        "wall_s": round(wall_s, 1),
        "samples": [vars(s) for s in run.samples],
    }


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (per second)."""
    if len(points) < 2:
        return 0.0
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


def summary(r: dict[str, Any]) -> str:
    c, rss = r["config"], r["rss"]
    ttft, e2e = r["ttft_s"], r["e2e_s"]
    cpu = r["cpu_share_of_one_core_after_warmup"]
    return "\n".join(
        [
            f"soak: {c['sessions']} sessions, {c['duration_s']:g} s "
            f"(warm-up {c['warmup_s']:g} s), sim x {c['workers']}",
            f"turns {r['turns']} ({r['turn_rate_per_s']}/s after warm-up; "
            f"{r['offered_rate_at_zero_latency_per_s']}/s offered at zero latency), "
            f"errors {r['errors']} (rate {r['error_rate']:.3%}): {r['error_kinds']}",
            f"TTFT p50/p99 {ttft['p50']} / {ttft['p99']} s; "
            f"e2e p50/p99 {e2e['p50']} / {e2e['p99']} s",
            f"appliance RSS start/middle/end {rss['start']['appliance_mib']} / "
            f"{rss['middle']['appliance_mib']} / {rss['end']['appliance_mib']} MiB "
            f"({rss['appliance_growth_start_to_end']:+.1%}, flat: {rss['rss_flat']}; "
            f"{rss['appliance_slope_mib_per_min']:+.2f} MiB/min; sessions held "
            f"{rss['start']['sessions_held']} / {rss['end']['sessions_held']}); workers "
            f"{rss['start']['workers_mib']} / {rss['middle']['workers_mib']} / "
            f"{rss['end']['workers_mib']} MiB",
            f"CPU (share of one core): appliance {cpu['appliance']}, workers {cpu['workers']}, "
            f"client {cpu['client']}; machine busy {r['machine_busy_after_warmup']}; "
            f"client loop lag p99 {r['client_loop_lag_ms']['p99_median_of_samples']} ms",
            f"tasks closed {r['tasks_closed']}, events failed {r['task_events_failed']}; "
            f"ledger {r['ledger_mib_end']} MiB; drain {r['drain_s']} s, wall {r['wall_s']} s",
        ]
    )


def grown(trace: Path, out: Path, top: int = 25) -> list[str]:
    """What the appliance allocated and still held between its two snapshots, by line and
    by traceback; written to `out`, the lines returned."""
    import tracemalloc

    first, second = trace.with_name(f"{trace.name}.1"), trace.with_name(f"{trace.name}.2")
    deadline = time.monotonic() + 120
    while not second.exists() and time.monotonic() < deadline:  # a large heap takes a while
        time.sleep(1)
    old = tracemalloc.Snapshot.load(str(first))
    new = tracemalloc.Snapshot.load(str(second))
    by_line = [str(d) for d in new.compare_to(old, "lineno")[:top]]
    lines = ["by line:", *by_line, "", "by traceback (5 frames):"]
    for d in new.compare_to(old, "traceback")[:10]:
        lines.append(f"{d.size_diff / 2**20:+.1f} MiB, {d.count_diff:+d} blocks")
        lines += [f"    {frame}" for frame in d.traceback.format()]
    out.write_text("\n".join(lines) + "\n")
    return by_line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=400)
    p.add_argument("--duration", type=float, default=600.0, help="Seconds of load.")
    p.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="Seconds before the RSS start and the latency figures (default: 60, or 10 %% "
        "of the duration when that is less).",
    )
    p.add_argument("--out", type=Path, default=Path("soak.json"))
    p.add_argument("--turns", type=int, default=10, help="Turns per task (session).")
    p.add_argument("--think-s", default="0.5,2", help="Pause between turns: uniform lo,hi.")
    p.add_argument("--context-words", type=int, default=600, help="A task's system prompt.")
    p.add_argument("--tool-words", type=int, default=60, help="Tool output per turn.")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--one-session",
        action="store_true",
        help="Each agent keeps one X-Session-ID across its tasks (default: a new session per "
        "task), so the router holds `--sessions` sessions however many tasks end.",
    )
    p.add_argument("--turn-timeout-s", type=float, default=120.0)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--progress-s", type=float, default=30.0)
    p.add_argument("--drain", type=float, default=120.0, help="Most seconds to finish turns.")
    p.add_argument("--keep", type=Path, default=None, help="Copy the data dir and logs here.")
    p.add_argument(
        "--trace-memory",
        type=Path,
        default=None,
        help="Run the appliance under tracemalloc (slower), snapshot it at the end of the "
        "warm-up and of the run, and write what grew between them to this file.",
    )
    args = p.parse_args(argv)
    args.think_s = tuple(float(x) for x in args.think_s.split(","))
    if args.warmup is None:
        args.warmup = min(60.0, args.duration * 0.1)
    if args.sessions < 1 or args.duration <= 0 or not 0 <= args.warmup < args.duration:
        raise SystemExit("need --sessions >= 1, --duration > 0 and 0 <= --warmup < --duration")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    data_dir = Path(tempfile.mkdtemp(prefix="soak-"))
    t = time.monotonic()
    try:
        trace = data_dir / "trace" if args.trace_memory else None
        with appliance_up(data_dir, trace) as up:
            print(f"appliance up in {time.monotonic() - t:.1f} s at {up.url}", flush=True)
            run = Run(args, up)
            t = time.monotonic()
            drain_s = eventloop.run(drive(run))
            result = report(run, drain_s, time.monotonic() - t)
            if up.proc.poll() is not None:
                raise SystemExit(f"appliance up exited ({up.proc.returncode}) during the run")
            if trace is not None:
                result["memory_growth_top"] = grown(trace, args.trace_memory)
    finally:
        if args.keep:
            shutil.copytree(data_dir, args.keep, dirs_exist_ok=True)
        shutil.rmtree(data_dir, ignore_errors=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result))
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
