#!/usr/bin/env bash
# Issue 18's checks on a GPU host without TensorFlow (the lent device machine: nvcc, CuPy,
# PyTorch, compute-sanitizer, ncu): build tfclip._core with CUDA, run the CUDA suite on the GPU,
# run it under compute-sanitizer, and the benchmark against PyTorch. Logs go to $OUT (the
# device tool brings that folder back), or ./gpu-out.
#
#   scripts/gpu_session.sh build test sanitize      # one device call (about 10 minutes)
#   scripts/gpu_session.sh build bench               # another (the build is not kept between)
#
# Knobs (environment): TFCLIP_GPU_ARCH (90), TFCLIP_SAN_K (the sanitizers' -k), TFCLIP_SAN_TOOLS
# (memcheck racecheck synccheck), TFCLIP_STEP_TIMEOUT (below), TFCLIP_BENCH_ARGS
# (gpu_bench.py's arguments; a second bench step appends to the same log), PYTEST_ADDOPTS (e.g.
# "-n 8" for the test step: the host has pytest-xdist).
#
# Steps: build, test, sanitize, bench. Each prints a one-line verdict; the script's exit status
# is the first failing step's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
# Hopper only: the lent machines are H100/H200, and one architecture compiles in about a minute.
ARCH="${TFCLIP_GPU_ARCH:-90}"
# The sanitizers' share of the suite: every kernel, dtype pair and path, not every parameter.
SAN_K="${TFCLIP_SAN_K:-not 2_pow_31 and (float32 or blocks or ring or allocate or sparse_row or device_scalars or tensor_norms or agc)}"
# TFCLIP_STEP_TIMEOUT (seconds): each test, sanitizer and bench command is stopped after it, so a
# lease's fixed time still brings back every step's log.
T=()
[ -n "${TFCLIP_STEP_TIMEOUT:-}" ] && T=(timeout -k 5 "$TFCLIP_STEP_TIMEOUT")
SAN_TOOLS="${TFCLIP_SAN_TOOLS:-memcheck racecheck synccheck}"
status=0

step_build() {
  { nvidia-smi; nvcc --version; "$PY" -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)'; } \
    > "$OUT/machine.txt" 2>&1
  PYTHON="$PY" BUILD_DIR=build-gpu ./build_ops.sh -DTFCLIP_WITH_TF=OFF -DTFCLIP_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="$ARCH" > "$OUT/build.log" 2>&1
  local rc=$?
  ldd tfclip/_core*.so >> "$OUT/build.log" 2>&1
  # A CPU call and a CUDA call first: a module that crashes on its first call (2026-11-26: a
  # statically linked libstdc++ whose symbols bound to the process's own) fails here, not as
  # every test's worker crashing.
  PYTHONPATH="$PWD" "$PY" -X faulthandler -c 'import numpy as np; from tfclip import _core
print("_core cuda", _core.cuda, _core.cuda_device(), "cpu isa", _core.cpu_isa())
print("global_norm of [1, 1, 1]:", _core.global_norm([np.ones(3)]))' \
    >> "$OUT/build.log" 2>&1 || rc=1
  echo "build rc=$rc"; tail -2 "$OUT/build.log"
  return $rc
}

step_test() {
  TFCLIP_REQUIRE_GPU=1 "${T[@]}" "$PY" -m pytest -q -p no:cacheprovider -rs --durations=15 tests/gpu \
    > "$OUT/pytest-gpu.log" 2>&1
  local rc=$?
  echo "tests/gpu rc=$rc"; tail -3 "$OUT/pytest-gpu.log"
  return $rc
}

step_sanitize() {
  local rc=0 tool r
  for tool in $SAN_TOOLS; do
    TFCLIP_REQUIRE_GPU=1 PYTEST_ADDOPTS= "${T[@]}" compute-sanitizer --tool "$tool" --error-exitcode 86 \
      "$PY" -m pytest -q -p no:cacheprovider tests/gpu -k "$SAN_K" > "$OUT/sanitize-$tool.log" 2>&1
    r=$?
    echo "compute-sanitizer $tool rc=$r"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize-$tool.log" | tail -2
    [ $r -ne 0 ] && rc=$r
  done
  return $rc
}

step_bench() {
  # TFCLIP_BENCH_ARGS replaces the arguments (e.g. "--clip agc --sets bert_base --iters 20").
  # shellcheck disable=SC2086
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "${T[@]}" "$PY" benchmarks/gpu_bench.py ${TFCLIP_BENCH_ARGS:---rules adam,adamw,sgdm --grad-dtypes float32,bfloat16 --profile} \
    >> "$OUT/gpu-bench.txt" 2>&1
  local rc=$?
  echo "gpu_bench rc=$rc"; cat "$OUT/gpu-bench.txt"
  return $rc
}

[ $# -eq 0 ] && set -- build test sanitize bench
for s in "$@"; do
  case "$s" in
    build|test|sanitize|bench) "step_$s" || { r=$?; [ $status -eq 0 ] && status=$r; [ "$s" = build ] && exit $r; } ;;
    *) echo "unknown step: $s (build, test, sanitize, bench)"; exit 2 ;;
  esac
done
exit $status
