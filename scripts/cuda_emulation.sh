#!/usr/bin/env bash
# Runs the CUDA code without a GPU: builds tfclip._core from the production cuda/*.cu against the
# CPU emulation of CUDA (cuda/emulation/, -DTFCLIP_CUDA_EMULATION=ON) and runs the CUDA-vs-CPU
# parity suite (tests/gpu) on it with TFCLIP_REQUIRE_GPU=1, so any skip is a failure (but the
# GPU-only >2^31-element case).
#   scripts/cuda_emulation.sh            (uses `python` on PATH: numpy, ml_dtypes, pytest, pybind11, cmake)
#   scripts/cuda_emulation.sh --tsan     (the same under ThreadSanitizer; slower, not in CI)
#   PYTHON=/path/python scripts/cuda_emulation.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
TSAN=OFF
if [ "${1:-}" = "--tsan" ]; then TSAN=ON; shift; fi
BUILD="${BUILD_DIR:-build-emu}"
[ "$TSAN" = ON ] && BUILD="${BUILD}-tsan"
cmake -S . -B "$BUILD" -DPython_EXECUTABLE="$("$PY" -c 'import sys;print(sys.executable)')" \
  -DTFCLIP_WITH_TF=OFF -DTFCLIP_CUDA_EMULATION=ON -DTFCLIP_TSAN="$TSAN" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)" --target _core
CORE="$(ls "$BUILD"/_core*.so | head -n 1)"
echo "+ emulated-CUDA _core: $CORE"
if [ "$TSAN" = ON ]; then
  # Python is not instrumented: preload the runtime. Every report fails the run.
  export LD_PRELOAD="$("${CC:-gcc}" -print-file-name=libtsan.so)"
  export TSAN_OPTIONS="halt_on_error=1:abort_on_error=1:report_signal_unsafe=0"
fi
TFCLIP_REQUIRE_GPU=1 TFCLIP_CORE_MODULE="$CORE" "$PY" -m pytest -q -p no:cacheprovider tests/gpu "$@"
