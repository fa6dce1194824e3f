"""`appliance up` as a user starts it: a real process on free local ports, real HTTP."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.running import BIN, add_key, appliance_process

__all__ = ["BIN", "RunningAppliance"]


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
    health_seen: list[str] = field(default_factory=list)
    """What its `/health` said while it started, each once, in order."""

    def words(self, n: int) -> int:
        return max(1, int(n * self.scale))

    @property
    def ledger(self) -> Path:
        return self.data_dir / "ledger.db"


@pytest.fixture(scope="module", params=["sim", pytest.param("vllm", marks=pytest.mark.vllm)])
def appliance_up(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningAppliance]:
    """`appliance up` on two workers: simulated, and real vLLM (CPU build, tiny model)."""
    engine = request.param
    data_dir = tmp_path_factory.mktemp(f"appliance-{engine}")
    keys = {n: add_key(data_dir, n) for n in ("alice", "bob")}
    keys["ops"] = add_key(data_dir, "ops", "--admin")
    env = {"APPLIANCE_ENGINE__MAX_MODEL_LEN": "65536"}
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
    with appliance_process(data_dir, engine=engine, env=env) as up:
        yield RunningAppliance(
            up.url,
            keys,
            data_dir,
            up.proc,
            up.base_port,
            up.log,
            engine,
            model,
            scale,
            up.health_seen,
        )
