#!/usr/bin/env bash
# In-place developer build: compiles the TF op library and tfclip._core into tfclip/ so that
# `python -m pytest` and `python -m tfclip.demo` run from the checkout.
#   ./build_ops.sh            (uses `python` on PATH; it must import tensorflow)
#   PYTHON=/path/python ./build_ops.sh -DTFCLIP_WITH_TF=OFF   (_core only, e.g. a GPU host)
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python}"
BUILD="${BUILD_DIR:-build}"
cmake -S . -B "$BUILD" -DPython_EXECUTABLE="$("$PY" -c 'import sys;print(sys.executable)')" \
  -DTFCLIP_OUTPUT_DIR="$PWD/tfclip" -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)"
