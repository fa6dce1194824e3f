"""CPU cost of the operator console at 2 Hz with 10,000 sessions in the state.

    .venv/bin/python benchmarks/console_refresh.py [--sessions 10000] [--seconds 20]
        [--screens overview,sessions,tasks] [--size 160x48]

A fake appliance in another process serves `/admin/v1/state` snapshots (pre-encoded, a new
one for each request, so every refresh has changed numbers). The console runs as
`python -m tui` in a pseudo-terminal of the given size, exactly as an operator runs it; the
benchmark reads its output as a terminal would and, after a warm-up on each screen, reports
the console process's CPU time over `--seconds` as a percentage of one core, and the
refresh rate it kept (snapshots fetched per second). The acceptance bar is < 30 % of one
core at 2 Hz.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import multiprocessing as mp
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the fake appliance lives with the console's tests

from tests.tui.fakes import ADMIN_KEY, FakeAppliance, make_state  # noqa: E402

SCREEN_KEYS = {"overview": "1", "sessions": "2", "tasks": "3", "costs": "4", "events": "5"}


def serve(n_sessions: int, conn: Connection) -> None:
    states = [make_state(n_sessions, n_tasks=n_sessions // 5, tick=i) for i in range(6)]
    fake = FakeAppliance()
    fake.cycle(states)
    fake.up()
    conn.send((fake.url, len(fake._body)))
    while True:
        if conn.poll(0.2):
            if conn.recv() == "count":
                conn.send(fake.state_requests())
            else:
                break
    fake.down()


def drain(fd: int, stop: threading.Event) -> None:
    """Reads the console's output, as a terminal does, so it never blocks on a full pty."""
    while not stop.is_set():
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                if not os.read(fd, 1 << 16):
                    return
            except OSError:
                return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--screens", default="overview,sessions,tasks")
    parser.add_argument("--size", default="160x48")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    cols, rows = (int(x) for x in args.size.split("x"))

    ours, theirs = mp.Pipe()
    server = mp.Process(target=serve, args=(args.sessions, theirs), daemon=True)
    server.start()
    url, body_bytes = ours.recv()

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["TERM"] = "xterm-256color"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tui", "--url", url, "--api-key", ADMIN_KEY],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    stop = threading.Event()
    reader = threading.Thread(target=drain, args=(master, stop), daemon=True)
    reader.start()
    console = psutil.Process(proc.pid)
    results = []
    try:
        time.sleep(args.warmup)
        for screen in args.screens.split(","):
            os.write(master, SCREEN_KEYS[screen].encode())
            time.sleep(args.warmup)
            ours.send("count")
            fetched0 = ours.recv()
            cpu0 = sum(console.cpu_times()[:2])
            t0 = time.monotonic()
            time.sleep(args.seconds)
            cpu1 = sum(console.cpu_times()[:2])
            elapsed = time.monotonic() - t0
            ours.send("count")
            fetched1 = ours.recv()
            results.append(
                {
                    "screen": screen,
                    "cpu_pct_of_one_core": round(100 * (cpu1 - cpu0) / elapsed, 1),
                    "refresh_hz": round((fetched1 - fetched0) / elapsed, 2),
                }
            )
        if proc.poll() is not None:
            raise SystemExit(f"the console exited early with status {proc.returncode}")
    finally:
        os.write(master, b"q")
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        stop.set()
        ours.send("stop")
        server.join(timeout=5)
        os.close(master)
    summary = {
        "sessions": args.sessions,
        "snapshot_bytes": body_bytes,
        "size": args.size,
        "seconds": args.seconds,
        "cpu_count": os.cpu_count(),
        "load_1m": round(os.getloadavg()[0], 2),
        "results": results,
    }
    if args.json:
        print(json.dumps(summary))
        return
    print(
        f"console refresh: {args.sessions:,} sessions ({body_bytes / 1e6:.1f} MB a snapshot), "
        f"{args.size}, {args.seconds:.0f} s per screen, load {summary['load_1m']}"
    )
    for r in results:
        verdict = "ok" if r["cpu_pct_of_one_core"] < 30 and r["refresh_hz"] >= 1.9 else "OVER"
        print(
            f"  {r['screen']:<9} {r['refresh_hz']:.2f} Hz  "
            f"{r['cpu_pct_of_one_core']:5.1f} % of one core  {verdict}"
        )


if __name__ == "__main__":
    main()
