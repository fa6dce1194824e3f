"""The console in a real terminal while the idle reaper moves sessions between tiers:
`appliance top` in tmux against `appliance up --engine sim` with a small GPU pool and a host
tier, read back with `tmux capture-pane`.

The load: a few sessions run turns with short tool waits (held on the GPU); sessions that
wait for an approval take one turn each, then a flood of new sessions' prompts, a few times
the pool and the host tier (twice the pool), pushes sessions off the GPU (their host copy
remains) and then off the host tier too. The Sessions screen shows held, host-only and
evicted sessions, and sessions that go from the GPU to the host tier to nowhere; the
Overview's KV figure ("KV tok", the KV index's count) equals the sum of the sessions'
resident GPU tokens within one block per session, in the same state document during the
load and on the screen once the load has stopped.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.running import add_key, appliance_process
from tests.tui.test_tmux import ROOT, TMUX, Terminal, console_command

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
BLOCK = 32
POOL_TOKENS = 8192
HOST_TOKENS = 16384
SIM_KV_BYTES_PER_TOKEN = 131_072
"""The bundled H200 profile's: the pools are given in bytes."""
HELD, WAITING, FLOOD = 3, 8, 24
"""Sessions with short tool waits, sessions waiting for an approval, flood sessions."""


@dataclass
class Tiers:
    url: str
    data_dir: Path
    key: str
    admin: str

    def state(self) -> dict[str, object]:
        r = httpx.get(
            f"{self.url}/admin/v1/state",
            headers={"Authorization": f"Bearer {self.admin}"},
            timeout=10,
        )
        r.raise_for_status()
        state: dict[str, object] = r.json()
        return state


@pytest.fixture(scope="module")
def tiers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tiers]:
    data_dir = tmp_path_factory.mktemp("appliance-tiers")
    key, admin = add_key(data_dir, "agents"), add_key(data_dir, "ops", "--admin")
    env = {
        "APPLIANCE_ENGINE__MAX_MODEL_LEN": "4096",
        "APPLIANCE_ENGINE__KV_CACHE_MEMORY_BYTES": str(POOL_TOKENS * SIM_KV_BYTES_PER_TOKEN),
        "APPLIANCE_ENGINE__KV_HOST_BYTES": str(HOST_TOKENS * SIM_KV_BYTES_PER_TOKEN),
    }
    with appliance_process(data_dir, workers=1, env=env, startup_s=120) as up:
        yield Tiers(up.url, data_dir, key, admin)


def turn(http: httpx.Client, session: str, messages: list[dict[str, str]], wait_s: float) -> str:
    tool = "api" if wait_s < 60 else "approval"
    r = http.post(
        "/v1/chat/completions",
        json={"model": "sim", "messages": messages, "max_tokens": 8, "ignore_eos": True},
        headers={
            "X-Session-ID": session,
            "X-Tool-Class": tool,
            "X-Expected-Tool-Wait-S": str(wait_s),
        },
    )
    r.raise_for_status()
    content: str = r.json()["choices"][0]["message"]["content"]
    return content


class TierLoad:
    """HELD sessions taking a turn every second; WAITING sessions that take one turn and wait
    for an approval; then FLOOD one-turn sessions, two at a time, until `stop()`."""

    def __init__(self, app: Tiers) -> None:
        self.app = app
        self.errors: list[str] = []
        self.flooded = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._held, args=(i,)) for i in range(HELD)]
        self._threads += [threading.Thread(target=self._flood, args=(i,)) for i in range(2)]

    def __enter__(self) -> TierLoad:
        with self._client() as http:
            for j in range(WAITING):
                words = f"approval {j} " + " ".join(f"w{j}x{k}" for k in range(500))
                turn(http, f"wait-{j}", [{"role": "user", "content": words}], 3600)
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def _client(self) -> httpx.Client:
        auth = {"Authorization": f"Bearer {self.app.key}"}
        return httpx.Client(base_url=self.app.url, headers=auth, timeout=60)

    def _held(self, i: int) -> None:
        system = f"agent {i} " + " ".join(f"a{i}y{k}" for k in range(300))
        history = [{"role": "system", "content": system}]
        try:
            with self._client() as http:
                for step in range(10_000):
                    if self._stop.is_set():
                        return
                    history.append({"role": "user", "content": f"step {step} " * 3})
                    answer = turn(http, f"held-{i}", history, 1.0)
                    history.append({"role": "assistant", "content": answer})
                    self._stop.wait(1.0)
        except httpx.HTTPError as exc:
            self.errors.append(f"held-{i}: {exc}")

    def _flood(self, lane: int) -> None:
        time.sleep(4.0)  # the waiting sessions' turns end first, and the console sees them
        try:
            with self._client() as http:
                for n in range(lane, FLOOD, 2):
                    if self._stop.is_set():
                        return
                    words = f"flood {n} " + " ".join(f"f{n}z{k}" for k in range(900))
                    turn(http, f"flood-{n}", [{"role": "user", "content": words}], 3600)
                    self.flooded += 1
                    self._stop.wait(1.5)
        except httpx.HTTPError as exc:
            self.errors.append(f"flood {lane}: {exc}")


@pytest.fixture
def terminal(tiers: Tiers) -> Iterator[Terminal]:
    term = Terminal(f"appliance-tiers-{os.getpid()}")
    env = [f"APPLIANCE_DATA_DIR={tiers.data_dir}", "TERM=xterm-256color", "COLORTERM="]
    console = " ".join(["env", "-u", "COLUMNS", "-u", "LINES", *console_command(tiers.url)])
    args = ["new-session", "-d", "-s", "top", "-x", "180", "-y", "60", "-c", str(ROOT)]
    for e in env:
        args += ["-e", e]
    subprocess.run([TMUX, "-L", term.socket, *args, console], check=True, timeout=10)
    try:
        yield term
    finally:
        subprocess.run([TMUX, "-L", term.socket, "kill-server"], check=False, timeout=10)


ROW = re.compile(
    r"^((?:held|wait|flood)-\d+)\s+agents\s+\S+\s+w0\s+(\d+|\d+\.\dk)\s+(\d+|\d+\.\dk)\s+"
    r"(\d+|\d+\.\dk)\s"
)
"""A Sessions row: id, tenant, task, worker, GPU tokens, host tokens, held tokens."""


def tokens(cell: str) -> int:
    return round(float(cell[:-1]) * 1000) if cell.endswith("k") else int(cell)


def session_rows(screen: str) -> dict[str, tuple[int, int, int]]:
    """Session id -> (GPU, host, held) tokens, as the Sessions screen shows them."""
    found = (ROW.match(line) for line in screen.splitlines())
    return {m.group(1): (tokens(m[2]), tokens(m[3]), tokens(m[4])) for m in found if m}


KV_TOK = re.compile(r"^\s*w0\s+sim\s+awake\s+\d+\s+\d+\s+[█░ ]*\s*\d+%\s+(\d+|\d+\.\dk)\s", re.M)
"""The Overview's Workers row: worker, engine, health, running, waiting, KV use, KV tok."""


def kv_gap(state: dict[str, object]) -> tuple[int, int, int]:
    """(the worker's KV tokens, the sessions' resident GPU tokens summed, the sessions)."""
    [worker] = state["workers"]  # type: ignore[misc]
    sessions = state["sessions"]
    assert isinstance(sessions, list) and isinstance(worker, dict)
    total = sum(s["resident_tokens"]["gpu"] for s in sessions)
    return worker["kv_tokens"], total, len(sessions)


def test_sessions_change_tier_and_the_overview_kv_is_their_sum(
    tiers: Tiers, terminal: Terminal
) -> None:
    seen: dict[str, list[tuple[int, int, int]]] = {}
    kinds: set[str] = set()
    with TierLoad(tiers) as load:
        terminal.wait_for(lambda s: "w0" in s and "KV tok" in s, "the Overview with KV tok")
        terminal.press("2")
        terminal.wait_for(lambda s: "GPU tok" in s and "wait-0" in s, "the Sessions screen")
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and not (
            {"held", "host", "gone"} <= kinds and _moved(seen)
        ):
            for sid, cells in session_rows(terminal.screen()).items():
                if not seen.get(sid) or seen[sid][-1] != cells:
                    seen.setdefault(sid, []).append(cells)
                gpu, host, held = cells
                kinds |= {"held"} if held > 0 else set()
                kinds |= {"host"} if gpu == 0 and host > 0 else set()
                kinds |= {"gone"} if gpu == 0 and host == 0 else set()
            kv, total, n = kv_gap(tiers.state())
            assert abs(kv - total) <= BLOCK * n, (kv, total, n)  # one document, one moment
            time.sleep(0.5)
        moved = sorted(k for k, cells in seen.items() if _went_through_tiers(cells))
        print(f"tiers seen {sorted(kinds)}; {load.flooded} floods; GPU, host, gone: {moved}")
        assert load.errors == []
    assert {"held", "host", "gone"} <= kinds, (kinds, seen)
    assert _moved(seen), seen
    assert any(len({c[0] > 0 for c in cells}) == 2 for cells in seen.values())

    # The load has stopped: the Overview's figure against the sessions' sum, on the screen.
    time.sleep(2.0)
    terminal.press("1")
    screen = terminal.wait_for(lambda s: KV_TOK.search(s) is not None, "the KV tok figure")
    time.sleep(1.5)  # a fresh snapshot of the quiet appliance
    match = KV_TOK.search(terminal.screen())
    assert match, screen
    _, total, n = kv_gap(tiers.state())
    assert abs(tokens(match.group(1)) - total) <= BLOCK * n + 50, (match.group(1), total, n)


def _moved(seen: dict[str, list[tuple[int, int, int]]]) -> bool:
    """Some session went from the GPU to the host tier only to neither."""
    return any(_went_through_tiers(cells) for cells in seen.values())


def _went_through_tiers(cells: list[tuple[int, int, int]]) -> bool:
    """On the GPU, then on the host tier only, then on neither, in that order."""
    stages = [0 if gpu > 0 else 1 if host > 0 else 2 for gpu, host, _ in cells]
    return stages[:1] == [0] and 1 in stages and stages[-1] == 2 and stages == sorted(stages)
