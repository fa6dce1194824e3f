"""`appliance up` as a user starts it: a real process on free local ports, real HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from tests.ports import free_port, free_port_block

BIN = Path(sys.executable).parent


@dataclass
class RunningAppliance:
    url: str
    keys: dict[str, str]
    data_dir: Path
    proc: subprocess.Popen[bytes]
    base_port: int
    log: Path
    engine: str
    model: str
    scale: float
    """Prompt sizes relative to the simulated engine's (the tiny real model has 4k context)."""

    def words(self, n: int) -> int:
        return max(1, int(n * self.scale))

    @property
    def ledger(self) -> Path:
        return self.data_dir / "ledger.db"


def _key(data_dir: Path, name: str, *extra: str) -> str:
    out = subprocess.run(
        [str(BIN / "appliance"), "keys", "add", name, *extra, "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


@pytest.fixture(scope="module", params=["sim", pytest.param("vllm", marks=pytest.mark.vllm)])
def appliance_up(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningAppliance]:
    """`appliance up` on two workers: simulated, and real vLLM (CPU build, tiny model)."""
    engine = request.param
    data_dir = tmp_path_factory.mktemp(f"appliance-{engine}")
    keys = {n: _key(data_dir, n) for n in ("alice", "bob")}
    keys["ops"] = _key(data_dir, "ops", "--admin")
    port, base, kv = free_port(), free_port_block(2), free_port_block(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    env.update(
        APPLIANCE_DATA_DIR=str(data_dir),
        APPLIANCE_ENGINE__BASE_PORT=str(base),
        APPLIANCE_ENGINE__KV_EVENTS_BASE_PORT=str(kv),
        APPLIANCE_ENGINE__MAX_MODEL_LEN="65536",
    )
    model, scale = "sim", 1.0
    if engine == "vllm":
        model_dir = request.getfixturevalue("tiny_model_dir")
        env.update(
            APPLIANCE_ENGINE__MODEL=str(model_dir),
            APPLIANCE_ENGINE__PYTHON=request.getfixturevalue("vllm_python"),
            APPLIANCE_ENGINE__MAX_MODEL_LEN="4096",
            APPLIANCE_ENGINE__KV_CACHE_MEMORY_BYTES=str(64 * 2**20),
        )
        model, scale = model_dir.name, 0.25
    log = data_dir / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                str(BIN / "appliance"),
                "up",
                "--engine",
                "sim",
                "--workers",
                "2",
                "--port",
                str(port),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"appliance up did not become healthy:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    running = RunningAppliance(url, keys, data_dir, proc, base, log, engine, model, scale)
    children = psutil.Process(proc.pid).children(recursive=True)
    yield running
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("appliance up did not stop within 60 s of SIGTERM")
    time.sleep(0.5)
    left = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes left after stop: {left}"
