#!/usr/bin/env bash
# Builds tfclip._core with AddressSanitizer + UndefinedBehaviorSanitizer (no TensorFlow, no CUDA)
# and runs the core's property tests (tests/test_core_properties.py: random lists, dtypes, clip
# modes, rules and sparse updates against NumPy float64) against that build. Any ASan or UBSan
# report aborts the run with a non-zero exit. The CPU passes are built once, for the baseline
# instruction set (TFCLIP_ISA_VARIANTS=OFF): every variant is the same source, and a run executes
# only one of them; the AVX variants' bits are checked against it in tests/test_core_parity.py.
# -O1 -g1 (line tables: the reports still name file and line): the sanitizers' instrumentation
# made the -O2 -g build of the baseline's pass_sparse.cc alone take 167 s on a 2-core EPYC
# (2026-12-05), 79 s at -O1 -g1; the tests themselves run in seconds.
#   scripts/sanitize.sh                 (uses `python` on PATH: numpy, pytest, hypothesis, pybind11, cmake)
#   PYTHON=/path/python scripts/sanitize.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
BUILD="${BUILD_DIR:-build-sanitize}"
cmake -S . -B "$BUILD" -DPython_EXECUTABLE="$("$PY" -c 'import sys;print(sys.executable)')" \
  -DTFCLIP_WITH_TF=OFF -DTFCLIP_CUDA=OFF -DTFCLIP_SANITIZE=ON -DTFCLIP_ISA_VARIANTS=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" >/dev/null
cmake --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)" --target _core
CORE="$(ls "$BUILD"/_core*.so | head -n 1)"
CC_BIN="${CC:-gcc}"
PRELOAD="$("$CC_BIN" -print-file-name=libasan.so) $("$CC_BIN" -print-file-name=libubsan.so)"
echo "+ sanitized _core: $CORE"
# Python is not instrumented: preload the runtimes; its own allocations at exit are not ours (no
# leak check). UBSan findings are fatal.
LD_PRELOAD="$PRELOAD" \
ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:strict_string_checks=1:check_initialization_order=1" \
UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" \
TFCLIP_CORE_MODULE="$CORE" \
  "$PY" -m pytest -q -p no:cacheprovider tests/test_core_properties.py "$@"
