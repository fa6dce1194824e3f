"""The console in a real terminal: `appliance top` in tmux against `appliance up --engine sim`
under a live agent load, read back with `tmux capture-pane`.

Agents open a root task, fan it out to child tasks and run multi-turn sessions in them while
the console runs; the test reads the Overview (workers and their KV bars, the simulated
GPUs' HBM bars), the Sessions table and the Tasks tree and sees them change; once the agents
stop it opens a session's detail, releases it, finds the release in the Sessions table and
on the Events screen, and quits with `q`. It also checks the real appliance's snapshot
against the console's schema, and the session routes and their ledger row over HTTP.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from appliance.api.admin.schemas import AdminStateView, convert_state
from appliance.ledger import open_reader
from tests.running import BIN, add_key, appliance_process, eventually
from tests.tui.test_schemas import unknown_keys

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
ROOT = Path(__file__).resolve().parents[2]
TMUX = shutil.which("tmux") or "/usr/bin/tmux"
AGENTS = 3
CHILDREN = 2


@dataclass
class Appliance:
    url: str
    data_dir: Path
    tenant_key: str
    admin_key: str


@pytest.fixture(scope="module")
def appliance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    data_dir = tmp_path_factory.mktemp("appliance-top")
    tenant = add_key(data_dir, "agents")
    admin = add_key(data_dir, "ops", "--admin")
    with appliance_process(data_dir, startup_s=120) as up:
        yield Appliance(up.url, data_dir, tenant, admin)


class AgentLoad:
    """AGENTS orchestrators, each with a root task fanned out to CHILDREN child tasks; every
    child runs a session whose context grows turn by turn, until `stop()`."""

    def __init__(self, app: Appliance) -> None:
        self.app = app
        self.turns = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._agent, args=(i,), daemon=True) for i in range(AGENTS)
        ]

    def __enter__(self) -> AgentLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)

    def _agent(self, i: int) -> None:
        headers = {"Authorization": f"Bearer {self.app.tenant_key}"}
        with httpx.Client(base_url=self.app.url, headers=headers, timeout=30) as http:
            try:
                root = f"plan-{i}"
                r = http.post("/v1/tasks", json={"task_id": root, "task_class": "code"})
                r.raise_for_status()
                kids = [f"plan-{i}-step-{k}" for k in range(CHILDREN)]
                for kid in kids:
                    body = {"task_id": kid, "parent_task_id": root, "deadline_s": 600}
                    http.post("/v1/tasks", json=body).raise_for_status()
                history = {
                    kid: [{"role": "system", "content": f"agent {i} {kid} " * 40}] for kid in kids
                }
                turn = 0
                while not self._stop.is_set():
                    kid = kids[turn % len(kids)]
                    history[kid].append({"role": "user", "content": f"step {turn} " * 20})
                    r = http.post(
                        "/v1/chat/completions",
                        json={
                            "model": "sim",
                            "messages": history[kid],
                            "max_tokens": 8,
                            "ignore_eos": True,
                        },
                        headers={
                            "X-Session-ID": f"agent-{i}-{kid[-6:]}",
                            "X-Task-ID": kid,
                            "X-Tool-Class": "shell",
                            "X-Expected-Tool-Wait-S": "2",
                        },
                    )
                    r.raise_for_status()
                    answer = r.json()["choices"][0]["message"]["content"]
                    history[kid].append({"role": "assistant", "content": answer})
                    self.turns += 1
                    turn += 1
                    self._stop.wait(0.2)
            except httpx.HTTPError as exc:
                self.errors.append(f"agent {i}: {exc}")


def console_command(url: str) -> list[str]:
    """`appliance top --url URL`; until the CLI is wired to `run_console`, `python -m tui`,
    which runs the same console."""
    from cli import console

    if "_later(" in inspect.getsource(console.top):
        return [sys.executable, "-m", "tui", "--url", url]
    return [str(BIN / "appliance"), "top", "--url", url]


class Terminal:
    def __init__(self, socket_name: str) -> None:
        self.socket = socket_name

    def tmux(self, *args: str) -> str:
        out = subprocess.run(
            [TMUX, "-L", self.socket, *args], capture_output=True, text=True, timeout=10
        )
        return out.stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "top")

    def press(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "top", *keys)

    def wait_for(self, check: Callable[[str], bool], what: str, timeout_s: float = 30) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.screen()
            if check(text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; the terminal shows:\n{text}")
            time.sleep(0.2)


@pytest.fixture
def terminal(appliance: Appliance) -> Iterator[Terminal]:
    term = Terminal(f"appliance-top-{os.getpid()}")
    env = [f"APPLIANCE_DATA_DIR={appliance.data_dir}", "TERM=xterm-256color", "COLORTERM="]
    # pytest exports COLUMNS/LINES (80x24); they would override the pane's real size.
    console = " ".join(["env", "-u", "COLUMNS", "-u", "LINES", *console_command(appliance.url)])
    cmd = f"{console}; echo $? > {appliance.data_dir}/top.status"  # tmux 3.3 may lag on it
    args = ["new-session", "-d", "-s", "top", "-x", "160", "-y", "48", "-c", str(ROOT)]
    for e in env:
        args += ["-e", e]
    subprocess.run([TMUX, "-L", term.socket, *args, cmd], check=True, timeout=10)
    term.tmux("set-option", "-t", "top", "remain-on-exit", "on")  # keep what it printed last
    try:
        yield term
    finally:
        subprocess.run([TMUX, "-L", term.socket, "kill-server"], check=False, timeout=10)


CLOCK = re.compile(r"(\d\d:\d\d:\d\dZ)\s*$")


def snapshot_clock(screen: str) -> str | None:
    match = CLOCK.search(screen.splitlines()[0]) if screen else None
    return match.group(1) if match else None


def test_the_real_snapshot_is_the_consoles_schema(appliance: Appliance) -> None:
    r = httpx.get(
        f"{appliance.url}/admin/v1/state",
        headers={"Authorization": f"Bearer {appliance.admin_key}"},
        timeout=10,
    )
    r.raise_for_status()
    convert_state(r.json())
    assert unknown_keys(AdminStateView, r.json()) == []


GPU_LINE = re.compile(
    r"^(GPU\d) H200 sim\s+([█▓░]+) +(\d+\.\d)/(\d+\.\d) GiB KV (\d+\.\d)\s+util\s+(\d+%)"
)


WORKER_KV = re.compile(r"^\s*(w\d)\s+sim\s+awake\s+\d+\s+\d+\s+[█░]+\s+(\S+)\s+(\S+)\s")


def worker_kv(screen: str) -> dict[str, tuple[str, str]]:
    """Each awake worker's KV use and KV tokens, as the Overview shows them."""
    found = (WORKER_KV.match(line) for line in screen.splitlines())
    return {m.group(1): (m.group(2), m.group(3)) for m in found if m}


TURN_ROW = re.compile(r"^\s*[0-9a-f]{32}\s+\d\d:\d\d:\d\dZ\s+w[01]\s.*\sok\b", re.M)
"""A row of the session detail's turns: turn id, start, worker, ..., outcome ok."""


def gpu_lines(screen: str) -> dict[str, tuple[str, ...]]:
    """The simulated GPUs' lines: bar, used GiB, total GiB, KV GiB, util, by GPU."""
    found = (GPU_LINE.match(line.strip()) for line in screen.splitlines())
    return {m.group(1): m.groups()[1:] for m in found if m}


def test_top_in_a_real_terminal_under_agent_load(appliance: Appliance, terminal: Terminal) -> None:
    ops = {"Authorization": f"Bearer {appliance.admin_key}"}
    with AgentLoad(appliance) as load:
        # Overview: both workers with KV bars, and one simulated GPU per worker with its
        # HBM bar, said to be simulated.
        screen = terminal.wait_for(
            lambda s: "w0" in s and "w1" in s and set(gpu_lines(s)) == {"GPU0", "GPU1"},
            "the Overview with the simulated GPUs' bars",
        )
        state = httpx.get(f"{appliance.url}/admin/v1/state", headers=ops, timeout=10).json()
        assert state["gpu_driver"].startswith("simulated") and len(state["gpus"]) == 2
        # Each worker's KV pool is known (its /metrics' cache config), and the modelled GPUs
        # draw more than idle power and warm up while the agents keep them busy.
        assert all(w["kv_capacity_tokens"] > 0 for w in state["workers"]), state["workers"]
        warm = eventually(
            lambda: httpx.get(f"{appliance.url}/admin/v1/state", headers=ops, timeout=10).json(),
            lambda s: any(g["power_w"] > 150 and g["temp_c"] > 40.5 for g in s["gpus"]),
        )
        assert any(g["power_w"] > 150 and g["temp_c"] > 40.5 for g in warm["gpus"]), warm["gpus"]
        assert "simulated by the sim engine's GPU model, not measured" in screen
        first = gpu_lines(screen)
        for bar, used, total, kv, _util in first.values():
            assert float(total) == round(state["gpus"][0]["mem_total_bytes"] / 2**30, 1)
            assert float(used) >= 1.0 and float(kv) <= float(used) < float(total)
            assert "▓" in bar and "░" in bar
        # A worker's KV use counts what its GPU holds, cached blocks too: not 0 % between
        # turns while its KV tokens grow.
        screen = terminal.wait_for(
            lambda s: any(tok != "0" for _, tok in worker_kv(s).values()), "KV on a worker"
        )
        assert all(use != "0%" for use, tok in worker_kv(screen).values() if tok != "0"), screen
        # The bars follow the agents' load: used memory, KV and utilisation move.
        terminal.wait_for(lambda s: gpu_lines(s) not in ({}, first), "the GPU bars to update")
        assert re.search(r"w0\s+\S+\s+awake", screen) and ("█" in screen or "░" in screen)
        assert load.errors == []

        # Sessions: the agents' sessions appear with resident tokens, and the view updates.
        terminal.press("2")
        screen = terminal.wait_for(
            lambda s: sum(f"agent-{i}-" in s for i in range(AGENTS)) == AGENTS,
            "every agent's sessions",
        )
        assert "GPU tok▼" in screen
        first = snapshot_clock(screen)
        turns_before = load.turns
        later = terminal.wait_for(
            lambda s: snapshot_clock(s) not in (None, first) and load.turns > turns_before + 3,
            "a newer snapshot on the Sessions screen",
        )
        rows = [line for line in later.splitlines() if line.startswith("agent-")]
        assert len(rows) == AGENTS * CHILDREN
        assert any(re.search(r"\s(\d{3,}|\d+\.\dk)\s", row) for row in rows), rows

        # Tasks: each plan fans out to its steps.
        terminal.press("3")
        screen = terminal.wait_for(
            lambda s: all(f"plan-{i}-step-1" in s for i in range(AGENTS)), "the fan-out trees"
        )
        for i in range(AGENTS):
            assert re.search(rf"▼ plan-{i} \[code\]\s+open", screen), screen
        assert "├─ plan-0-step-0" in screen and "└─ plan-0-step-1" in screen
        # The tree follows the snapshots: the steps' deadline slack counts down. (Their
        # token counts would too, but the appliance does not add turns' tokens to tasks yet.)
        step = re.compile(r"plan-0-step-0\s+open\s+slack (\S+)")
        before = step.search(screen)
        assert before, screen
        terminal.wait_for(
            lambda s: (m := step.search(s)) is not None and m.group(1) != before.group(1),
            "the tree's deadline slack to count down",
        )
        assert load.errors == []

    # The agents stopped: open the most resident session, see its residency and turns,
    # release it, and find the release in the table and among the events.
    terminal.press("2")
    terminal.wait_for(lambda s: "GPU tok▼" in s and "agent-" in s, "the Sessions table")
    terminal.press("Enter")
    screen = terminal.wait_for(
        lambda s: "Residency" in s and TURN_ROW.search(s) is not None,
        "the session's detail with its residency and turns",
    )
    session = re.search(r"Session (agent-\S+)", screen)
    assert session, screen
    # Its residency row: on the GPU, held there if its hold has not lapsed yet.
    assert re.search(r"^\s*w[01]\s+gpu(_held)?\s+[\d,]+\s+\d", screen, re.M), screen
    terminal.press("x")
    terminal.wait_for(lambda s: "Release the KV cache held by session" in s, "the confirmation")
    terminal.press("y")
    terminal.wait_for(lambda s: f"Session {session.group(1)}: released (" in s, "the release")
    terminal.press("Escape")
    terminal.wait_for(
        lambda s: (
            re.search(rf"^{session.group(1)}\s.*\sreleased\s+released by operator", s, re.M)
            is not None
        ),
        "the released session in the table",
    )
    terminal.press("5")
    terminal.wait_for(
        lambda s: re.search(rf"\srelease\s+{session.group(1)}\s+agents\s", s) is not None,
        "the release on the Events screen",
    )

    # `q` quits and gives the terminal back.
    status_file = appliance.data_dir / "top.status"
    terminal.press("q")
    deadline = time.monotonic() + 15
    while not status_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert status_file.exists(), f"the console did not exit on q:\n{terminal.screen()}"
    time.sleep(0.1)
    assert status_file.read_text().strip() == "0", terminal.screen()
    assert "Traceback" not in terminal.screen()


def test_session_detail_and_release_over_http(appliance: Appliance) -> None:
    tenant = {"Authorization": f"Bearer {appliance.tenant_key}"}
    ops = {"Authorization": f"Bearer {appliance.admin_key}"}
    body = {"model": "sim", "messages": [{"role": "user", "content": "hello " * 300}]}
    for _ in range(2):
        r = httpx.post(
            f"{appliance.url}/v1/chat/completions",
            json=body | {"max_tokens": 4},
            headers=tenant | {"X-Session-ID": "ops/check 1"},
            timeout=30,
        )
        r.raise_for_status()
    path = f"{appliance.url}/admin/v1/sessions/ops%2Fcheck%201"
    deadline = time.monotonic() + 10  # the ledger commits a turn just after its answer
    while True:
        detail = httpx.get(path, params={"tenant": "agents"}, headers=ops, timeout=10)
        assert detail.status_code == 200, detail.text
        data = detail.json()
        if len(data["turns"]) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert data["session"]["id"] == "ops/check 1" and data["session"]["turns"] == 2
    assert [t["outcome"] for t in data["turns"]] == ["ok", "ok"]
    assert data["turns"][1]["cached_tokens"] > 0
    assert sum(r["tokens"] for r in data["residency"]) > 0

    assert httpx.post(f"{path}/release", headers=tenant, timeout=10).status_code == 403
    missing = httpx.get(f"{appliance.url}/admin/v1/sessions/nope", headers=ops, timeout=10)
    assert missing.status_code == 404
    released = httpx.post(f"{path}/release", params={"tenant": "agents"}, headers=ops, timeout=10)
    assert released.status_code == 200, released.text
    assert released.json()["released_tokens"] == data["session"]["resident_tokens"]["gpu"]

    state = httpx.get(f"{appliance.url}/admin/v1/state", headers=ops, timeout=10).json()
    (row,) = [s for s in state["sessions"] if s["id"] == "ops/check 1"]
    assert (row["decision"], row["reason"]) == ("released", "released by operator")
    assert any(
        e["kind"] == "release" and e["subject"] == "ops/check 1" and e["tenant"] == "agents"
        for e in state["events"]
    )
    # The terminal commands carry the same: `events` lists the release, `status --json`
    # the whole snapshot with the simulated GPUs, the cost series and the events.
    cli = [str(BIN / "appliance"), "--url", appliance.url, "--key", appliance.admin_key]
    listed = subprocess.run(
        [cli[0], "events", *cli[1:], "--json"], capture_output=True, text=True, timeout=60
    )
    assert listed.returncode == 0, listed.stderr
    assert any(e["subject"] == "ops/check 1" for e in json.loads(listed.stdout)["events"])
    status = subprocess.run(
        [cli[0], "status", *cli[1:], "--json"], capture_output=True, text=True, timeout=60
    )
    full = json.loads(status.stdout)
    assert full["gpu_driver"].startswith("simulated") and full["costs"]["series"]
    assert any(e["kind"] == "release" for e in full["events"])
    with contextlib.closing(open_reader(appliance.data_dir / "ledger.db")) as conn:
        rows = conn.execute(
            "SELECT action, reason, tokens FROM residency_events WHERE session_id = ?",
            ["agents/ops/check 1"],
        ).fetchall()
    by_operator = [tuple(r) for r in rows if r[1] == "released by operator"]
    assert by_operator == [("release", "released by operator", released.json()["released_tokens"])]
    assert {r[0] for r in rows} <= {"hold", "release", "evict"}  # the idle reaper's, besides
