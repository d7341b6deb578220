#!/usr/bin/env bash
# Proof of power of the emulated CUDA suite (issue 34): runs the tests of the normal suite
# (tests/gpu) that reach each planted fault, one fault at a time, on the emulated build of
# scripts/cuda_emulation.sh (BUILD_DIR, default build-emu; built here if absent). That build
# compiles in every fault's switch (TFCLIP_PLANTED(NAME) in csrc/core/cuda/*.cu and
# cuda_kernels.cuh), off unless the environment's TFCLIP_PLANT names it; the product build
# compiles each to `false`. Every planted run must FAIL; the script exits 1 if one passes (a hole:
# close it with a schedule, the race detector or a test, never by dropping the fault).
# CI runs it after scripts/cuda_emulation.sh has passed the whole suite on the same build with no
# fault planted, so a failure here is the planted fault's.
#   PYTHON=.venv/bin/python scripts/planted_faults.sh           # CI: the emulation's defaults
#                                                                # (every schedule in turn, race detector on)
#   scripts/planted_faults.sh --matrix [fault...]    # also each policy alone with the detector off, and
#                                                    # the detector alone (random order): cuda/README.md's table
#   scripts/planted_faults.sh reuse_barrier chunk_end   # only these faults
# (Until 2026-11-29 each fault was a compile-time #ifdef and a rebuild of the csrc/core/cuda/*.cu
# files: 13 rebuilds, most of this step's 387 s in CI.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
MATRIX=0
if [ "${1:-}" = "--matrix" ]; then MATRIX=1; shift; fi
BUILD="${BUILD_DIR:-build-emu}"

# name | its switch (TFCLIP_PLANTED(...), the value of TFCLIP_PLANT) | the tests of tests/gpu that reach it (pytest -k)
FAULTS=(
  "reuse_barrier|REUSE_BARRIER|lamb"
  "publish_barrier|PUBLISH_BARRIER|test_global_norm_parity or test_clip_by_global_norm_parity"
  "tail_stride|TAIL_STRIDE|misaligned"
  "chunk_end|CHUNK_END|test_global_norm_parity"
  "skip_ignored|SKIP_IGNORED|nonfinite"
  "agc_unit|AGC_UNIT|test_agc_dense_parity"
  "agc_block|AGC_BLOCK|test_agc_dense_parity"
  "q8_warp_max|Q8_WARP_MAX|test_int8_state_parity"
  "q8_code|Q8_CODE|test_int8_state_parity"
  "grad_scale|GRAD_SCALE|test_grad_scale_on_the_device"
  "round_tensor|ROUND_TENSOR|test_cuda_draws_the_cpu_bits"
  "factored_row|FACTORED_ROW|adafactor"
  "factored_barrier|FACTORED_BARRIER|adafactor"
  "bf16_slot_store|BF16_SLOT_STORE|test_bf16_state_parity"
)
# What each fault is (csrc/core/cuda/*.cu have the same words where it acts).
declare -A WHAT=(
  [reuse_barrier]="no __syncthreads() before the second of two consecutive block reductions (BlockSum's first barrier)"
  [publish_barrier]="no __syncthreads() between a block reduction's warp_sums writes and warp 0's reads"
  [tail_stride]="the apply's scalar loop strides by the block (kThreads) where its crew is a warp"
  [chunk_end]="a chunk followed by another of its tensor ends one element early"
  [skip_ignored]="the apply kernel ignores the skip flag (status->apply)"
  [agc_unit]="AGC's apply reads the scale of the next unit (i + 1) % units"
  [agc_block]="AGC's norm pass writes every row block's partials to block 0"
  [q8_warp_max]="int8 state: each lane quantizes with its own elements' absmax, not its block's (no butterfly)"
  [q8_code]="int8 state: every slot quantized with the signed code, the second moments too"
  [grad_scale]="the finalize's clip factors without grad_scale (the loss-scale unscale left out of the apply)"
  [round_tensor]="stochastic rounding: the dense apply draws every variable's bits as the first variable's (its position left out)"
  [factored_row]="Adafactor: a row's sum of g^2 + epsilon_1 loses its last element"
  [factored_barrier]="Adafactor: no __syncthreads() between storing r and each matrix's mean of it"
  [bf16_slot_store]="bfloat16 state: the dense apply's vector path leaves the last slot's new values unstored"
)

BUILD_DIR="$BUILD" PYTHON="$PY" scripts/cuda_emulation.sh --build-only >/dev/null
CORE="$(ls "$BUILD"/_core*.so | head -n 1)"
mkdir -p "$BUILD/planted"

# run LABEL KSUBSET ENV...: the subset under the given emulation settings; prints PASS or FAIL
# and, on a failure, the emulation's message or pytest's first failure.
run() {
  local label="$1" k="$2"
  shift 2
  local log="$BUILD/planted/$label.log" t0=$SECONDS rc=0
  # A time limit per run: a fault that hangs the suite must not hang CI (a subset takes seconds).
  env "$@" TFCLIP_PLANT="$PLANT" TFCLIP_REQUIRE_GPU=1 TFCLIP_CORE_MODULE="$CORE" timeout "${PLANT_TIMEOUT:-300}" "$PY" -m pytest \
    -q -x -p no:cacheprovider tests/gpu -k "$k" >"$log" 2>&1 || rc=$?
  if [ "$rc" = 0 ]; then
    printf '  %-34s PASS (%ds)\n' "$label" $((SECONDS - t0))
    return 1
  fi
  if [ "$rc" = 5 ]; then
    # pytest's "no tests collected": the -k subset names no test, so nothing was tried. That is
    # a broken script, not a caught fault.
    echo "  $label: no test matches -k '$k' (pytest exit 5): the fault was not tried" >&2
    exit 2
  fi
  local why
  if [ "$rc" = 124 ]; then
    why="the suite hung (stopped after ${PLANT_TIMEOUT:-300} s)"
  else
    why="$(grep -m1 -o 'tfclip CUDA emulation: .*' "$log" || grep -m1 '^FAILED' "$log" || tail -n 1 "$log")"
  fi
  printf '  %-34s FAIL (%ds): %s\n' "$label" $((SECONDS - t0)) "${why:0:240}"
}

holes=()
for spec in "${FAULTS[@]}"; do
  IFS='|' read -r name macro subset <<<"$spec"
  if [ $# -gt 0 ] && [[ " $* " != *" $name "* ]]; then continue; fi
  echo "+ planted fault $name: ${WHAT[$name]}"
  PLANT="$macro"
  if ! run "default (cycle + race detector)" "$subset"; then holes+=("$name"); fi
  if [ "$MATRIX" = 1 ]; then
    for p in random warp-desc warp-asc thread; do
      run "$p alone, detector off" "$subset" TFCLIP_EMU_SCHEDULE=$p TFCLIP_EMU_RACECHECK=0 || true
    done
    run "detector alone (random order)" "$subset" TFCLIP_EMU_SCHEDULE=random TFCLIP_EMU_RACECHECK=1 || true
  fi
done
if [ ${#holes[@]} -gt 0 ]; then
  echo "planted faults the emulated suite does not catch: ${holes[*]}" >&2
  exit 1
fi
echo "every planted fault fails the emulated suite"
