#!/usr/bin/env bash
# Builds, on a development machine, the modules a lent GPU host runs (tfclip._core with CUDA and
# _jax_ffi, the XLA handlers against JAX's headers), so that a lease's 15 minutes are not spent
# compiling (135-139 s of its 16 cores on the H200 hosts): scripts/gpu_session.sh checks them with
# a CPU and a CUDA call first, and builds there only if they fail (TFCLIP_PREBUILT).
#
#   scripts/gpu_prebuild.sh              # -> .gpu-prebuilt/ (listed in .git/info/exclude by this script)
#   device run, carry [".gpu-prebuilt"]:  TFCLIP_PREBUILT=.gpu-prebuilt scripts/gpu_session.sh
#
# The host's Python minor version and jaxlib version must be the ones named below (the H200 image,
# 2026-12-04: Python 3.12.3, jax and jaxlib 0.11.2; ../.library/device/KINDS.md lists them); the CUDA
# toolkit's major version must match the host's (13). Knobs: GPU_PY (a python3.12), GPU_JAXLIB,
# TFCLIP_GPU_ARCH (90), PREBUILT (the output folder). The build runs in a git worktree of HEAD
# plus the working tree's changes (build-gpu-prebuild/), so the checkout's own in-place build is
# not touched.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
OUTDIR="${PREBUILT:-$ROOT/.gpu-prebuilt}"
JAXLIB="${GPU_JAXLIB:-0.11.2}"
ARCH="${TFCLIP_GPU_ARCH:-90}"
PY="${GPU_PY:-}"
if [ -z "$PY" ]; then
  for c in python3.12 "$HOME/.pyenv/versions/3.12"*/bin/python3.12 /root/.pyenv/versions/3.12*/bin/python3.12; do
    if command -v "$c" >/dev/null 2>&1; then PY="$(command -v "$c")"; break; fi
  done
fi
[ -n "$PY" ] || { echo "gpu_prebuild: no python3.12 here (set GPU_PY)" >&2; exit 2; }
VENV="${GPU_VENV:-$ROOT/build-gpu-prebuild/venv}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q numpy pybind11 cmake ninja "jaxlib==$JAXLIB"
fi
WT="$ROOT/build-gpu-prebuild/tree"
mkdir -p "$WT"
# HEAD's tracked files with the working tree's edits, and untracked files git does not ignore,
# their times kept (the tree's build stays incremental).
git ls-files -co --exclude-standard -z | xargs -0 cp -p --parents -t "$WT" 2>/dev/null || true
(cd "$WT" && PYTHON="$VENV/bin/python" BUILD_DIR=build ./build_ops.sh -G Ninja -DTFCLIP_WITH_TF=OFF \
  -DTFCLIP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DTFCLIP_ISA_VARIANTS=OFF -DTFCLIP_JAX_FFI=ON)
mkdir -p "$OUTDIR"
rm -f "$OUTDIR"/*.so "$OUTDIR"/_build_info.py
cp "$WT"/tfclip/_core*.so "$WT"/tfclip/_jax_ffi.so "$WT"/tfclip/_build_info.py "$OUTDIR"/
grep -qx '/.gpu-prebuilt/' .git/info/exclude 2>/dev/null || echo '/.gpu-prebuilt/' >> .git/info/exclude
# Their first CPU call here (a CUDA call needs the GPU): a module that does not load fails now.
(cd "$WT" && "$VENV/bin/python" -c 'import numpy as np; from tfclip import _core
print("prebuilt _core: cuda", _core.cuda, "global_norm([1, 1, 1]) =", _core.global_norm([np.ones(3)]))')
ls -la "$OUTDIR"
