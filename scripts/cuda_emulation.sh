#!/usr/bin/env bash
# Runs the CUDA code without a GPU: builds tfclip._core from the production csrc/core/cuda/*.cu against the
# CPU emulation of CUDA (cuda/emulation/, -DTFCLIP_CUDA_EMULATION=ON) and runs the CUDA-vs-CPU
# parity suite (tests/gpu) on it with TFCLIP_REQUIRE_GPU=1, so any skip is a failure (but the
# GPU-only >2^31-element case). Every kernel meets every schedule of the emulation in one run (the
# default TFCLIP_EMU_SCHEDULE=cycle) and the __shared__ race detector is on; at the end the script
# lists the kernels launched and the launches per schedule. The suite is split over EMU_JOBS
# pytest processes (default: the CPU count) run side by side.
#   scripts/cuda_emulation.sh            (uses `python` on PATH: numpy, ml_dtypes, pytest, pybind11, cmake)
#   scripts/cuda_emulation.sh --tsan     (under ThreadSanitizer, in CI: by default the subset below,
#                                        which reaches every kernel, every BlockSum/WarpSum call site,
#                                        the streams and the workspace ring, split over TSAN_JOBS
#                                        parallel pytest processes (default: the CPU count); it fails
#                                        if the subset stops launching a kernel. The whole suite takes
#                                        about an hour there. Pytest args replace the subset.)
#   PYTHON=/path/python scripts/cuda_emulation.sh [pytest args]
#   scripts/cuda_emulation.sh --build-only   (the build alone; scripts/planted_faults.sh runs on it)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
TSAN=OFF
BUILD_ONLY=0
if [ "${1:-}" = "--tsan" ]; then TSAN=ON; shift; fi
if [ "${1:-}" = "--build-only" ]; then BUILD_ONLY=1; shift; fi  # (scripts/planted_faults.sh)
BUILD="${BUILD_DIR:-build-emu}"
[ "$TSAN" = ON ] && BUILD="${BUILD}-tsan"
# The CPU reference here is the baseline variant alone (TFCLIP_ISA_VARIANTS=OFF): the variants give
# the same bits (tests/test_core_parity.py: test_every_cpu_variant_gives_the_same_bits), and compiling all three was most
# of this build's CPU-side time in CI. Debug info at -g1 (line tables: the reports, TSan's too,
# still name file and line): the full -g made the emulated apply.cu take 56 s against 41 s
# (2026-12-05, the 2-core EPYC).
cmake -S . -B "$BUILD" -DPython_EXECUTABLE="$("$PY" -c 'import sys;print(sys.executable)')" \
  -DTFCLIP_WITH_TF=OFF -DTFCLIP_CUDA_EMULATION=ON -DTFCLIP_TSAN="$TSAN" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
  -DTFCLIP_ISA_VARIANTS=OFF >/dev/null
# With jaxlib in this Python (CI installs the `jax` extra), the XLA handlers' JAX module too, for
# tests/xla_jax below (a second XLA runtime; two more files on this build's core).
TARGETS=(_core)
if [ "$TSAN" = OFF ] && "$PY" -c 'import jaxlib' 2>/dev/null; then TARGETS+=(_jax_ffi); fi
cmake --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)" --target "${TARGETS[@]}"
CORE="$(ls "$BUILD"/_core*.so | head -n 1)"
echo "+ emulated-CUDA _core: $CORE"
[ "$BUILD_ONLY" = 0 ] || exit 0
STATS="$BUILD/emu_stats"
rm -rf "$STATS"
mkdir -p "$STATS"

# kernel_stats REQUIRE: names the kernels the run launched (the emulation's TFCLIP_EMU_STATS files,
# symbolized with nm) with their launches per schedule; with REQUIRE=1, fails unless every kernel
# of csrc/core/cuda/*.cu and every instantiation of the trust-ratio rule (Lamb: the kernels
# with two consecutive BlockSums) was launched.
kernel_stats() {
  "$PY" - "$CORE" "$1" "$STATS"/*.txt <<'EOF'
import collections, re, subprocess, sys
core, require, files = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]
syms = {}
for line in subprocess.run(["nm", "-C", "--defined-only", core], capture_output=True, text=True,
                           check=True).stdout.splitlines():
    addr, kind, name = (line.split(" ", 2) + ["", ""])[:3]
    if kind in ("t", "T", "w", "W"):
        syms[int(addr, 16)] = name
KERNEL = re.compile(r"tfclip::cuda::\(anonymous namespace\)::(\w+Kernel)(<[^()]*>)?\(")
def short(name):
    m = KERNEL.search(name)
    return (m.group(1), m.group(2) or "") if m else (name, "")
compiled = {short(n) for n in syms.values() if KERNEL.search(n)}
launched = collections.defaultdict(lambda: [0, 0, 0, 0])
policies = []
for f in files:
    for line in open(f):
        if line.startswith("#"):
            policies = line.split(":")[-1].split()
            continue
        name, off, *counts = line.split()
        key = short(syms.get(int(off, 16), name))
        launched[key] = [a + int(b) for a, b in zip(launched[key], counts)]
by_kernel = collections.defaultdict(list)
for (k, inst), counts in launched.items():
    by_kernel[k].append(counts)
print("+ kernels launched (instantiations launched/compiled; fewest launches of one instantiation under "
      + ", ".join(policies) + ")")
for k in sorted({k for k, _ in compiled} | set(by_kernel)):
    n_compiled = sum(1 for c in compiled if c[0] == k)
    counts = by_kernel.get(k, [])
    fewest = [min(c[p] for c in counts) for p in range(len(policies))] if counts else []
    print(f"  {k:18} {len(counts)}/{n_compiled}  {' '.join(map(str, fewest))}")
if require:
    missing = sorted({k for k, _ in compiled} - set(by_kernel))
    missing += sorted(k + i for k, i in compiled if "LambRule" in i and (k, i) not in launched)
    if missing:
        sys.exit("the subset no longer launches: " + ", ".join(missing))
EOF
}

if [ "$TSAN" = ON ]; then
  # Python is not instrumented: preload the runtime. Every report fails the run.
  export LD_PRELOAD="$("${CC:-gcc}" -print-file-name=libtsan.so)"
  export TSAN_OPTIONS="halt_on_error=1:abort_on_error=1:report_signal_unsafe=0"
fi
TSAN_SUBSET='test_global_norm_parity or test_clip_by_global_norm_parity or test_clip_in_place or (test_apply_parity and float32-float32 and global_norm) or (test_sparse_apply_parity and float32-float32 and (adam or lamb)) or misaligned or nonfinite or stream or ring or no_wait or bad_inputs or host_memory or out_of_range or 16bit or blocks or allocate or test_agc_device_clip_eps_and_skip or (test_adafactor_cuda_same_bits_as_cpu and f32-f16grad)'
export TFCLIP_REQUIRE_GPU=1 TFCLIP_CORE_MODULE="$CORE"
unset TFCLIP_PLANT  # (the suite itself runs with no planted fault: scripts/planted_faults.sh sets one)
if [ $# -eq 0 ]; then
  # The suite (under TSan: the subset), dealt round-robin to JOBS pytest processes run side by
  # side (each emulated launch runs on one thread: one process kept one of CI's two cores idle).
  if [ "$TSAN" = ON ]; then
    JOBS="${TSAN_JOBS:-$(nproc 2>/dev/null || echo 2)}"
    mapfile -t IDS < <("$PY" -m pytest -q -p no:cacheprovider --collect-only tests/gpu -k "$TSAN_SUBSET" |
                       grep '::')
    echo "+ ThreadSanitizer: ${#IDS[@]} tests in $JOBS processes"
  else
    JOBS="${EMU_JOBS:-$(nproc 2>/dev/null || echo 2)}"
    mapfile -t IDS < <("$PY" -m pytest -q -p no:cacheprovider --collect-only tests/gpu | grep '::')
    echo "+ the emulated suite: ${#IDS[@]} tests in $JOBS processes"
  fi
  pids=()
  for ((j = 0; j < JOBS; j++)); do
    shard=()
    for ((i = j; i < ${#IDS[@]}; i += JOBS)); do shard+=("${IDS[$i]}"); done
    [ ${#shard[@]} -gt 0 ] || continue
    TFCLIP_EMU_STATS="$STATS/$j.txt" "$PY" -m pytest -q -p no:cacheprovider "${shard[@]}" \
      >"$STATS/pytest.$j.log" 2>&1 &
    pids+=($!)
  done
  fail=0
  for ((j = 0; j < ${#pids[@]}; j++)); do
    echo "+ shard $j:"
    if wait "${pids[$j]}"; then
      tail -n 1 "$STATS/pytest.$j.log"
    else
      fail=1
      cat "$STATS/pytest.$j.log"
    fi
  done
  [ "$fail" = 0 ] || exit 1
  if [ "$TSAN" = ON ]; then
    kernel_stats 1
    exit 0
  fi
  kernel_stats 0
else
  TFCLIP_EMU_STATS="$STATS/0.txt" "$PY" -m pytest -q -p no:cacheprovider tests/gpu "$@"
  kernel_stats 0
fi
# The XLA handlers under JAX's CPU runtime against the TF op (tests/xla_jax; its reasons to skip
# are failures with TFCLIP_REQUIRE_JAX=1, as CI sets).
if [ $# -eq 0 ]; then
  echo "+ the XLA handlers under JAX (tests/xla_jax)"
  TFCLIP_REQUIRE_GPU= TFCLIP_JAX_FFI_MODULE="$BUILD/_jax_ffi.so" "$PY" -m pytest -q -p no:cacheprovider -rs tests/xla_jax
fi
