"""packaging/ and `appliance service`: the files `service install` lays out, the unit as
systemd reads it (`systemd-analyze verify`), the unit's ExecStart run as written under a
local NOTIFY_SOCKET (ready once /health is ok, a watchdog, a reload, a stop that drains),
the container recipe and compose file through their linters, and shell completion.

No systemd runs here (no PID 1 of its own, no container runtime): the unit is checked by
systemd's own verifier and its command lines are run as systemd would run them, less the
user switch and the sandbox."""

from __future__ import annotations

import contextlib
import os
import queue
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from appliance.config.settings_yaml import documented_yaml
from appliance.start.service_files import unit_text
from tests.cli.test_cli import APPLIANCE, ROOT, run
from tests.ports import free_port, free_port_block
from tests.running import BIN

SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"
"""From Debian's systemd package: install.sh --dev installs it where it is missing."""


def _service(unit: Path) -> dict[str, list[str]]:
    """The [Service] section's settings, each key's values in order."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in unit.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


def test_service_install_lays_out_unit_user_config_and_data_dir(tmp_path: Path) -> None:
    r = run("service", "install", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    unit = tmp_path / "etc/systemd/system/appliance.service"
    config = tmp_path / "etc/appliance/appliance.yaml"
    data = tmp_path / "var/lib/appliance"
    assert unit.read_text() == unit_text(str(APPLIANCE))
    assert _service(unit)["ExecStart"] == [f"{APPLIANCE} up"]
    assert "u appliance - " in (tmp_path / "etc/sysusers.d/appliance.conf").read_text()
    assert config.read_text() == documented_yaml()
    assert data.is_dir() and data.stat().st_mode & 0o777 == 0o750
    assert r.stdout.splitlines()[-1].endswith("systemctl enable --now appliance'")
    config.write_text("engine: {model: /models/mine}\n")  # the operator's edit
    again = run("service", "install", "--root", str(tmp_path))
    assert f"kept  {config}" in again.stdout and "/models/mine" in config.read_text()
    status = run("service", "status", "--root", str(tmp_path))
    assert status.returncode == 0 and status.stdout.count("present") == 4
    gone = run("service", "uninstall", "--root", str(tmp_path))
    assert gone.returncode == 0 and not unit.exists() and config.exists() and data.is_dir()
    status = run("service", "status", "--root", str(tmp_path))
    assert status.returncode == 1 and f"missing  {unit}" in status.stdout


def test_the_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    assert run("service", "install", "--root", str(tmp_path)).returncode == 0
    unit = tmp_path / "etc/systemd/system/appliance.service"
    r = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stderr == "" and r.stdout == "", r.stderr + r.stdout


def test_packaging_holds_the_unit_service_install_writes_for_opt_appliance() -> None:
    packaging = ROOT / "packaging"
    exe = "/opt/appliance/.venv/bin/appliance"
    assert (packaging / "appliance.service").read_text() == unit_text(exe)
    assert (packaging / "appliance.sysusers").read_text() == (
        ROOT / "appliance/data/appliance.sysusers"
    ).read_text()


def test_the_container_recipe_and_compose_file_pass_their_linters() -> None:
    for argv in (
        [str(BIN / "hadolint"), "--failure-threshold", "info", "packaging/Dockerfile"],
        [
            str(BIN / "check-jsonschema"),
            "--builtin-schema",
            "vendor.compose-spec",
            "packaging/compose.yaml",
        ],
    ):
        r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr


def test_bash_completes_the_commands(tmp_path: Path) -> None:
    script = (
        'eval "$("$APP" --show-completion)"\n'
        'COMP_WORDS=(appliance st); COMP_CWORD=1; _appliance_completion "$APP"\n'
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("_")} | {"APP": str(APPLIANCE)}
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert set(r.stdout.split()) == {"status", "stop"}


class _Notifications:
    """A local NOTIFY_SOCKET, bound and read as systemd binds and reads it for a Type=notify
    service."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.messages.put(self.sock.recv(4096).decode())

    def until(self, field: str, timeout_s: float) -> list[str]:
        """Messages until one with `field` (which it returns last)."""
        deadline = time.monotonic() + timeout_s
        got = []
        while (left := deadline - time.monotonic()) > 0:
            try:
                message = self.messages.get(timeout=left)
            except queue.Empty:
                break
            got.append(message)
            if field in message.split("\n"):
                return got
        pytest.fail(f"no {field} within {timeout_s} s; got {got}")


def _environment(unit: Path, tmp_path: Path) -> dict[str, str]:
    """The unit's Environment= as written, its paths moved under tmp_path (no /etc or /var
    of ours here), and a config that runs one simulated worker on free ports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    env |= dict(e.split("=", 1) for e in _service(unit)["Environment"])
    assert env["APPLIANCE_CONFIG"] == "/etc/appliance/appliance.yaml"
    config = tmp_path / "appliance.yaml"
    config.write_text(
        f"server: {{port: {free_port()}}}\n"
        f"engine: {{kind: sim, workers: 1, base_port: {free_port_block(1)}, "
        f"kv_events_base_port: {free_port_block(1)}, "
        f"kv_retention_base_port: {free_port_block(1)}, sim_time_scale: 5}}\n"
    )
    for key, where in (
        ("APPLIANCE_CONFIG", config),
        ("APPLIANCE_DATA_DIR", tmp_path / "data"),
        ("APPLIANCE_LOG_DIR", tmp_path / "log"),
        ("HOME", tmp_path / "data"),
        ("XDG_CACHE_HOME", tmp_path / "cache"),
        ("HF_HOME", tmp_path / "cache/huggingface"),
    ):
        env[key] = str(where)
    return env


def test_exec_start_as_written_is_ready_once_healthy_reloads_and_drains(tmp_path: Path) -> None:
    assert run("service", "install", "--root", str(tmp_path / "root")).returncode == 0
    unit = tmp_path / "root/etc/systemd/system/appliance.service"
    service = _service(unit)
    env = _environment(unit, tmp_path)
    notes = _Notifications(tmp_path / "notify")
    env |= {"NOTIFY_SOCKET": str(notes.path), "WATCHDOG_USEC": "1000000"}
    port = int(Path(env["APPLIANCE_CONFIG"]).read_text().split("port: ")[1].split("}")[0])
    url = f"http://127.0.0.1:{port}"
    with (tmp_path / "out.log").open("wb") as out:
        proc = subprocess.Popen(
            shlex.split(service["ExecStart"][0]), env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        ready = notes.until("READY=1", 120)[-1]
        health = httpx.get(f"{url}/health", timeout=5)  # at READY=1: already ok
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert ready.startswith("READY=1\nSTATUS=serving at ")
        children = psutil.Process(proc.pid).children(recursive=True)
        notes.until("WATCHDOG=1", 3)
        notes.until("WATCHDOG=1", 3)  # every half of WATCHDOG_USEC

        reload = subprocess.run(
            shlex.split(service["ExecReload"][0]),
            env=env,
            timeout=60,
            capture_output=True,
            text=True,
        )
        assert reload.returncode == 0, reload.stderr
        assert any(m.startswith("RELOADING=1\nMONOTONIC_USEC=") for m in notes.until("READY=1", 5))

        answer = _turn_in_flight(url, tmp_path / "data")
        proc.send_signal(signal.SIGTERM)  # `systemctl stop`: KillMode=mixed, to the main process
        notes.until("STOPPING=1", 10)
        assert proc.wait(int(service["TimeoutStopSec"][0])) == 0
        answer["thread"].join(30)  # type: ignore[attr-defined]
    finally:
        proc.kill()
        notes.sock.close()
    assert answer["status"] == 200 and str(answer["text"]).rstrip().endswith("data: [DONE]")
    time.sleep(0.5)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    log = (tmp_path / "log/appliance.log").read_text()
    assert "SIGTERM: draining" in log and log.rstrip().endswith("appliance.start.daemon: stopped")


def _turn_in_flight(url: str, data_dir: Path) -> dict[str, object]:
    """A streamed turn, started and answering when this returns; its outcome lands in the
    dict when it ends."""
    keys = (data_dir / "api-keys.toml").read_text()
    key = keys.split('[keys.default]\nkey = "')[1].split('"')[0]
    answer: dict[str, object] = {}
    started = threading.Event()

    def turn() -> None:
        body = {
            "model": "sim",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 64,
            "stream": True,
        }
        with httpx.stream(
            "POST",
            f"{url}/v1/chat/completions",
            json=body,
            timeout=60,
            headers={"Authorization": f"Bearer {key}"},
        ) as r:
            started.set()
            answer["status"] = r.status_code
            answer["text"] = "".join(r.iter_text())

    answer["thread"] = thread = threading.Thread(target=turn)
    thread.start()
    assert started.wait(30)
    return answer
