#!/usr/bin/env bash
# Issue 42's checks on a lent GPU host without TensorFlow (nvcc, CuPy, PyTorch, JAX + optax,
# compute-sanitizer, ncu), in one device call: build tfclip._core and the JAX module of the XLA
# handlers (_jax_ffi) with CUDA; run the XLA handlers under JAX on the GPU (tests/xla_jax); the
# speed table (benchmarks/gpu_bench.py: copy bandwidth, tfclip _core, tfclip's XLA handler
# under jax.jit, PyTorch fused, optax under jax.jit); float32, bfloat16 and int8 optimizer state
# (benchmarks/gpu_state_bench.py, issue 47); ncu's DRAM figures for tfclip's norm and
# apply kernels; the CUDA suite on the GPU (tests/gpu); compute-sanitizer on a subset. Logs go to
# $OUT (the device tool brings that folder back), or ./gpu-out.
#
#   scripts/gpu_session.sh                           # every step, in the order below
#   TFCLIP_DEADLINE=540 scripts/gpu_session.sh ...   # stop every step by then (seconds from start)
#
# Knobs (environment): TFCLIP_GPU_ARCH (90), TFCLIP_SAN_K (the sanitizers' -k), TFCLIP_SAN_TOOLS
# (memcheck racecheck synccheck), TFCLIP_DEADLINE (below), TFCLIP_BENCH_ARGS (gpu_bench.py's
# arguments), TFCLIP_STATE_ARGS (gpu_state_bench.py's), TFCLIP_TEST_JOBS (pytest-xdist workers for
# tests/gpu, default 8).
#
# Steps: build, jax, test, state, bench, ncu, sanitize. Each prints a one-line verdict; the script's exit
# status is the first failing step's. Each step is given at most its own share of the time (the
# numbers in run_step's calls) and never past TFCLIP_DEADLINE, so a lease's fixed time still
# brings back every step's log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
# Hopper only: the lent machines are H100/H200 (this build took 135-139 s on the H200 host, 2026-11-27).
ARCH="${TFCLIP_GPU_ARCH:-90}"
# The sanitizers' share of the suite: every kernel, dtype pair and path, not every parameter.
# Each kernel at least once (every rule's apply instance, sparse, AGC, device scalars, per-tensor
# norms, int8 and bfloat16 state, stochastic rounding, the loss-scale fold, Adafactor's four
# passes): 204 of tests/gpu's 2,178 tests (2026-12-04).
SAN_K="${TFCLIP_SAN_K:-not 2_pow_31 and ((float32-float32 and apply_parity and (none or global_norm)) or (float32-float32 and sparse_apply_parity and global_norm) or blocks or ring or allocate or device_scalars or tensor_norms_same or (clip_apply_tensor_norms and float32) or (agc_dense_parity and float32) or agc_sparse or agc_device or adafactor_cuda_factored or adafactor_cuda_skip or (int8_state_parity and adam and not value) or int8_state_non_finite or (draws_the_cpu_bits and adam) or indexed_slices_rows or (grad_scale_on_the_device and adam and global_norm) or (bf16_state_parity and adam and global_norm))}"
DEADLINE="${TFCLIP_DEADLINE:-100000}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX beside PyTorch and _core on one GPU
T=()
# limit SECONDS: the command prefix T that stops a step after SECONDS, or at the deadline.
limit() {
  local left=$((DEADLINE - SECONDS)) want="$1"
  [ "$left" -lt "$want" ] && want="$left"
  [ "$want" -lt 5 ] && want=5
  T=(timeout -k 5 "$want")
}
SAN_TOOLS="${TFCLIP_SAN_TOOLS:-memcheck racecheck synccheck}"
status=0

# The first calls of the modules: a CPU call and a CUDA call. A module that crashes on its first
# call (2026-11-26: a statically linked libstdc++ whose symbols bound to the process's own) fails
# here, not as every test's worker crashing.
smoke() {
  PYTHONPATH="$PWD" "$PY" -X faulthandler -c 'import numpy as np; from tfclip import _core
print("_core cuda", _core.cuda, _core.cuda_device(), "cpu isa", _core.cpu_isa())
print("global_norm of [1, 1, 1]:", _core.global_norm([np.ones(3)]))
import ctypes, os; j = os.path.abspath("tfclip/_jax_ffi.so")
print("_jax_ffi", "loads" if os.path.exists(j) and ctypes.CDLL(j) else "not built")'
}

step_build() {
  { date -u; nvidia-smi; nvcc --version; nproc
    "$PY" -c 'import torch, cupy, jax, optax; print("torch", torch.__version__, "cupy", cupy.__version__, "jax", jax.__version__, "optax", optax.__version__, jax.devices())'; } \
    > "$OUT/machine.txt" 2>&1
  # TFCLIP_PREBUILT=DIR: _core and _jax_ffi built elsewhere for this host's Python, CUDA and jaxlib
  # (scripts/gpu_prebuild.sh, on a development machine: the build is 135-139 s of a 15-minute
  # lease here). Used when their first calls pass; else built here as below.
  if [ -n "${TFCLIP_PREBUILT:-}" ]; then
    cp "$TFCLIP_PREBUILT"/*.so "$TFCLIP_PREBUILT"/_build_info.py tfclip/ 2>"$OUT/build.log" &&
      ldd tfclip/_core*.so tfclip/_jax_ffi.so >> "$OUT/build.log" 2>&1 &&
      smoke >> "$OUT/build.log" 2>&1 && { echo "build: prebuilt modules from $TFCLIP_PREBUILT"; tail -3 "$OUT/build.log"; return 0; }
    echo "build: the prebuilt modules failed their first calls; building here"; tail -5 "$OUT/build.log"
    rm -f tfclip/_core*.so tfclip/_jax_ffi.so tfclip/_eager*.so tfclip/_build_info.py
  fi
  # (The CPU passes' AVX2/AVX-512 variants are left out: the GPU is what runs here. _jax_ffi is
  # built where jaxlib is (AUTO): without it the jax step fails, saying so, and the rest still run.)
  PYTHON="$PY" BUILD_DIR=build-gpu "${T[@]}" ./build_ops.sh -DTFCLIP_WITH_TF=OFF -DTFCLIP_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DTFCLIP_ISA_VARIANTS=OFF > "$OUT/build.log" 2>&1
  local rc=$?
  ldd tfclip/_core*.so tfclip/_jax_ffi.so >> "$OUT/build.log" 2>&1
  smoke >> "$OUT/build.log" 2>&1 || rc=1
  echo "build rc=$rc"; tail -2 "$OUT/build.log"
  return $rc
}

step_jax() {
  # The XLA handlers under JAX's runtime: CUDA on the GPU and Host on the CPU backend, each against
  # the core's CPU driver bit for bit, the donated buffers reused.
  TFCLIP_REQUIRE_GPU=1 TFCLIP_REQUIRE_JAX=1 "${T[@]}" "$PY" -m pytest -q -p no:cacheprovider -rs tests/xla_jax \
    > "$OUT/pytest-jax.log" 2>&1
  local rc=$?
  echo "tests/xla_jax rc=$rc"; tail -3 "$OUT/pytest-jax.log"
  return $rc
}

step_ncu() {
  # DRAM traffic and throughput of tfclip's kernels in one BERT-base Adam step (clocks as they run).
  PYTHONPATH="$PWD" "${T[@]}" ncu --clock-control none -k regex:'(Norm|Apply|Finalize)Kernel' -c 6 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    "$PY" benchmarks/gpu_bench.py --sets bert_base --rules adam --iters 1 --no-jax > "$OUT/ncu.txt" 2>&1
  local rc=$?
  # The apply kernel with float32, bfloat16 and int8 state (gpu_state_bench: per state its two
  # bit-for-bit check steps, then a first timed step: three apply kernels each).
  PYTHONPATH="$PWD" "${T[@]}" ncu --clock-control none -k regex:'ApplyKernel' -c 9 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    "$PY" benchmarks/gpu_state_bench.py --sets bert_base --rules adam --iters 1 > "$OUT/ncu-state.txt" 2>&1
  local r2=$?
  [ $rc -eq 0 ] && rc=$r2
  echo "ncu rc=$rc"; grep -E "Kernel|dram__|gpu__time" "$OUT/ncu.txt" "$OUT/ncu-state.txt" | head -60
  return $rc
}

step_test() {
  TFCLIP_REQUIRE_GPU=1 "${T[@]}" "$PY" -m pytest -q -p no:cacheprovider -rs --durations=15 \
    -n "${TFCLIP_TEST_JOBS:-8}" tests/gpu > "$OUT/pytest-gpu.log" 2>&1
  local rc=$?
  echo "tests/gpu rc=$rc"; tail -3 "$OUT/pytest-gpu.log"
  return $rc
}

step_sanitize() {
  local rc=0 tool r left
  local -a tools=($SAN_TOOLS)
  left=${#tools[@]}
  for tool in "${tools[@]}"; do
    limit $(((DEADLINE - SECONDS) / left))  # the time left, shared by the tools left
    left=$((left - 1))
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
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "${T[@]}" "$PY" benchmarks/gpu_bench.py ${TFCLIP_BENCH_ARGS:---sets bert_base,bert_large --rules adam,sgdm --grad-dtypes float32 --iters 20 --profile} \
    >> "$OUT/gpu-bench.txt" 2>&1
  local rc=$?
  echo "gpu_bench rc=$rc"; cat "$OUT/gpu-bench.txt"
  return $rc
}

step_state() {
  # Issue 47's GPU figures: float32, bfloat16 and int8 optimizer state, one interleaved loop per
  # set and rule, each state's first two steps checked against the core's CPU steps first.
  # TFCLIP_STATE_ARGS replaces the arguments.
  # shellcheck disable=SC2086
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "${T[@]}" "$PY" benchmarks/gpu_state_bench.py ${TFCLIP_STATE_ARGS:---sets bert_base,small2000 --rules adam,sgdm --iters 20} \
    >> "$OUT/gpu-state-bench.txt" 2>&1
  local rc=$?
  echo "gpu_state_bench rc=$rc"; cat "$OUT/gpu-state-bench.txt"
  return $rc
}

# Each step's share of a lease, in seconds (cut at the deadline).
declare -A SHARE=([build]=240 [jax]=60 [test]=150 [bench]=150 [state]=100 [ncu]=70 [sanitize]=300)
[ $# -eq 0 ] && set -- build jax test state bench ncu sanitize
for s in "$@"; do
  case "$s" in
    build|jax|bench|state|ncu|test|sanitize)
      if [ $((DEADLINE - SECONDS)) -lt 10 ]; then echo "$s: not run (deadline)"; [ $status -eq 0 ] && status=124; continue; fi
      limit "${SHARE[$s]}"
      echo "== $s (at ${SECONDS} s, up to ${T[3]} s)"
      "step_$s" || { r=$?; [ $status -eq 0 ] && status=$r; [ "$s" = build ] && exit $r; } ;;
    *) echo "unknown step: $s (build, jax, bench, state, ncu, test, sanitize)"; exit 2 ;;
  esac
done
echo "== done at ${SECONDS} s"
exit $status
