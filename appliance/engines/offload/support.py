"""Whether the vLLM that the workers run has what the host tier is built on, asked before
any worker starts (a worker that lacked it would fail only at the end of its start, in its
log): vLLM 0.32's OffloadingConnector, MultiConnector and offloading spec factory. The
interpreter is asked where its vLLM is, without importing it (a second's work, not vLLM's
import); the files are looked for there.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from appliance.domain.errors import ConfigError

NEEDED = (
    "distributed/kv_transfer/kv_connector/v1/offloading_connector.py",
    "distributed/kv_transfer/kv_connector/v1/multi_connector.py",
    "v1/kv_offload/factory.py",
    "v1/kv_offload/cpu/spec.py",
)
_WHERE = "import importlib.util as u; s = u.find_spec('vllm'); print(s.origin if s else '')"


def missing_host_tier_support(vllm_package: Path) -> list[str]:
    """What of the host tier's vLLM modules the package directory lacks."""
    return [f"vllm/{path}" for path in NEEDED if not (vllm_package / path).is_file()]


def check_host_tier(python: str, *, timeout_s: float = 60.0) -> None:
    """Raises ConfigError, one line, when `python`'s vLLM cannot give the workers a host
    tier (`engine.kv_host_bytes`)."""
    try:
        done = subprocess.run(
            [python, "-c", _WHERE], capture_output=True, text=True, timeout=timeout_s
        )
        origin = done.stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(
            f"engine.kv_host_bytes: cannot ask {python} for its vLLM: {exc}"
        ) from None
    if not origin:
        return  # no vLLM at all: the engine's own check says so, with the install hint
    missing = missing_host_tier_support(Path(origin).parent)
    if missing:
        raise ConfigError(
            f"engine.kv_host_bytes: this vLLM has no {', '.join(missing)} (the host tier "
            "needs vLLM 0.32's offloading connector); set engine.kv_host_bytes: 0 or "
            "install vLLM 0.32"
        )
