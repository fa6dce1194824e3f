"""The host tier on CUDA (issue 38): the CPU build's end-to-end scenario
(tests/e2e/test_vllm_host_tier.py) on vLLM's CUDA build, where the tier is vLLM's own
(`CPUOffloadingSpec`, its CUDA copies) beside the retention connector: a session demoted
while a flood fills the pool comes back from host memory with at least 90 % of its prefix,
and the same answer and log-probabilities as with its prefix on the GPU; the ledger records
the demotion and the restore. A session whose task ends leaves vLLM's own tier at once.
Run by scripts/gpu_check.sh; skipped without a GPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_reaper import Reaped
from tests.e2e.test_vllm_host_tier import demote_and_restore, drop_at_task_end, host_tier_up

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cuda_hosted(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, vllm_python: str
) -> Iterator[Reaped]:
    yield from host_tier_up(tmp_path_factory, tiny_model_dir, vllm_python)


def test_a_demoted_session_comes_back_from_vllms_native_cpu_offloading(
    cuda_hosted: Reaped,
) -> None:
    demote_and_restore(cuda_hosted)


def test_a_closed_tasks_session_leaves_vllms_native_cpu_offloading(cuda_hosted: Reaped) -> None:
    drop_at_task_end(cuda_hosted)
