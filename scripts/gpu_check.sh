#!/usr/bin/env bash
# The GPU checks, one script: on a host with an NVIDIA GPU, installs the appliance with
# vLLM's CUDA build and the test tools (install.sh picks the build from nvidia-smi), writes
# one probe reading to $OUT/gpu_probe.json (or ./gpu_probe.json) and runs the tests marked
# `gpu` (tests/gpu/: NVML against nvidia-smi, a CUDA worker, vLLM's sleep mode at levels
# 1 and 2 through the supervisor, test_gpu_sleep.py, and the host tier: vLLM's native CPU
# offloading beside the retention connector, a session demoted through a flood and restored
# from host memory with its KV intact, test_gpu_host_tier.py). Extra arguments go to pytest.
# Without a GPU those tests are skipped and say why.
#
#   scripts/gpu_check.sh -k host_tier     only the host tier's demote and restore
#
#   scripts/gpu_check.sh            install, probe, test
#   SKIP_INSTALL=1 scripts/gpu_check.sh   reuse .venv as it is
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-.}
[ "${SKIP_INSTALL:-0}" = 1 ] || ./install.sh --dev
.venv/bin/python scripts/gpu_probe.py > "$out/gpu_probe.json"
echo "==> probe reading: $out/gpu_probe.json"
exec .venv/bin/pytest -m gpu -ra -p no:cacheprovider "$@"
