"""Shared fixtures: a generated tiny model and one real vLLM CPU server per test session.

Both are lazy: only tests that ask for them pay for them. Without a Python that has vLLM
(``$APPLIANCE_VLLM_PYTHON``, else this interpreter) they fail, never skip.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from tests.vllm_server import (
    RunningVllm,
    VllmServerError,
    ensure_tiny_model,
    resolve_vllm_python,
    running_vllm,
)

CACHE_ENV = "APPLIANCE_TEST_CACHE"
SESSION_KV_CACHE_BYTES = 32 * 2**20  # 32768 tokens: 1024 blocks of 32


def fail_without_traceback(exc: Exception) -> NoReturn:
    raise pytest.fail.Exception(str(exc), pytrace=False) from None


@pytest.fixture(scope="session")
def vllm_python() -> str:
    try:
        return resolve_vllm_python()
    except VllmServerError as exc:
        fail_without_traceback(exc)


@pytest.fixture(scope="session")
def tiny_model_dir(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama; built once per session, or once per cache dir if $CACHE_ENV is set."""
    cached = os.environ.get(CACHE_ENV)
    cache_dir = Path(cached) if cached else tmp_path_factory.mktemp("tiny-model")
    try:
        return ensure_tiny_model(vllm_python, cache_dir)
    except VllmServerError as exc:
        fail_without_traceback(exc)


@pytest.fixture(scope="session")
def vllm_server(
    vllm_python: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningVllm]:
    """One vLLM server for the session, publishing KV events to a subscriber bound beforehand."""
    workdir = tmp_path_factory.mktemp("vllm-server")
    try:
        with running_vllm(
            tiny_model_dir,
            workdir,
            python=vllm_python,
            kv_cache_memory_bytes=SESSION_KV_CACHE_BYTES,
        ) as handle:
            yield handle
    except VllmServerError as exc:
        fail_without_traceback(exc)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` run where NVML sees an NVIDIA GPU; elsewhere they are skipped, and
    the skip says why (a skipped test proves nothing: it is reported, never counted passed)."""
    marked = [item for item in items if item.get_closest_marker("gpu")]
    if not marked:
        return
    from appliance.gpu.nvml import NvmlProbe

    probe = NvmlProbe()
    snap = probe.snapshot()
    probe.close()
    if snap.gpus:
        return
    skip = pytest.mark.skip(reason=f"no NVIDIA GPU here ({snap.error or 'NVML lists none'})")
    for item in marked:
        item.add_marker(skip)


if os.environ.get("MUTANT_UNDER_TEST"):
    # Under mutation testing (scripts/mutation.py) every mutant reruns its tests: property
    # tests take fewer examples there (a mutant that breaks a property breaks it early), so
    # the run stays within its budget of CI time.
    from hypothesis import settings

    settings.register_profile("mutation", max_examples=30, deadline=None)
    settings.load_profile("mutation")
