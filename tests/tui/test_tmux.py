"""The console in a real terminal: `appliance top` in tmux against `appliance up --engine sim`
under a live agent load, read back with `tmux capture-pane`.

Agents open a root task, fan it out to child tasks and run multi-turn sessions in them the
whole time the console runs; the test reads the Overview (workers and their KV bars, GPU
bars or the calm no-GPU line), the Sessions table and the Tasks tree, sees them change, and
quits with `q`. It also checks the real appliance's snapshot against the console's schema.
"""

from __future__ import annotations

import inspect
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

from appliance.api.schemas import AdminState
from tests.running import BIN, add_key, appliance_process
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
                history = {kid: [{"role": "system", "content": f"agent {i} {kid} " * 40}]
                           for kid in kids}  # fmt: skip
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
    from cli import main as cli_main

    if "_later(" in inspect.getsource(cli_main.top):
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
    AdminState.model_validate(r.json())
    assert unknown_keys(AdminState, r.json()) == []


def test_top_in_a_real_terminal_under_agent_load(appliance: Appliance, terminal: Terminal) -> None:
    with AgentLoad(appliance) as load:
        # Overview: both workers with KV bars; GPU bars, or the calm line on a GPU-less host.
        screen = terminal.wait_for(
            lambda s: "w0" in s and "w1" in s and "Workers" in s, "the Overview"
        )
        gpus = httpx.get(
            f"{appliance.url}/admin/v1/state",
            headers={"Authorization": f"Bearer {appliance.admin_key}"},
            timeout=10,
        ).json()["gpus"]
        if gpus:
            screen = terminal.wait_for(
                lambda s: "GPU0" in s and "GiB" in s and ("▓" in s or "░" in s), "GPU bars"
            )
        else:
            assert "No NVIDIA GPU reported" in screen
        assert re.search(r"w0\s+\S+\s+ok", screen) and ("█" in screen or "░" in screen)
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
