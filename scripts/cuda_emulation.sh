#!/usr/bin/env bash
# Runs the CUDA code without a GPU: builds tfclip._core from the production csrc/core/*.cu against the
# CPU emulation of CUDA (cuda/emulation/, -DTFCLIP_CUDA_EMULATION=ON) and runs the CUDA-vs-CPU
# parity suite (tests/gpu) on it with TFCLIP_REQUIRE_GPU=1, so any skip is a failure (but the
# GPU-only >2^31-element case).
#   scripts/cuda_emulation.sh            (uses `python` on PATH: numpy, ml_dtypes, pytest, pybind11, cmake)
#   scripts/cuda_emulation.sh --tsan     (under ThreadSanitizer, not in CI: by default the subset
#                                        below, which reaches every kernel, the streams and the
#                                        workspace ring: 121 tests, about 9 minutes; the whole suite
#                                        takes about an hour there. Pytest args replace the subset.)
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
TSAN_SUBSET='test_global_norm_parity or test_clip_by_global_norm_parity or test_clip_in_place or (test_apply_parity and float32-float32) or (test_sparse_apply_parity and float32-float32 and adam) or misaligned or nonfinite or stream or ring or no_wait or bad_inputs or host_memory or out_of_range or 16bit or blocks or allocate'
if [ "$TSAN" = ON ] && [ $# -eq 0 ]; then set -- -k "$TSAN_SUBSET"; fi
TFCLIP_REQUIRE_GPU=1 TFCLIP_CORE_MODULE="$CORE" "$PY" -m pytest -q -p no:cacheprovider tests/gpu "$@"
