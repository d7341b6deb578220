#!/usr/bin/env bash
# The TensorFlow you have: for each TF version, a fresh venv where that TF is installed first, then
# the README's install command (`pip install ".[test]"`), which must build tfclip against it without
# changing it; then the suite's subset that reaches every front door. Prints a Markdown table
# (version x builds x TF unchanged x tests x XLA kernels) for docs/install.md.
#   scripts/tf_matrix.sh                 (2.15 2.16 2.17 2.18 2.19 2.20 2.21; about 15 minutes each here)
#   scripts/tf_matrix.sh 2.16 2.18       (some)
#   SUBSET="tests/test_apply.py" scripts/tf_matrix.sh 2.16
#   CMAKE_ARGS=-DTFCLIP_CUDA=OFF scripts/tf_matrix.sh ...   (skip the CUDA compile: much faster)
# Exit status: non-zero if any version fails to build, changes TF, or fails a test.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON_BIN:-python3}"
VERSIONS=("$@")
[ ${#VERSIONS[@]} -eq 0 ] && VERSIONS=(2.15 2.16 2.17 2.18 2.19 2.20 2.21)
# Every front door: the ops and their gradients, fused_clip_apply with every rule, the TF1
# drop-ins, the Keras drop-ins and a tf.distribute run (Keras 3: not on 2.15, where
# test_build_tf_versions checks that tfclip.keras names the problem), the build's version checks, and
# XLA where built.
KERAS3_ONLY="tests/test_dropin_keras.py tests/test_xla_keras.py tests/test_distribute.py::test_mirrored_two_replicas"
SUBSET="${SUBSET:-tests/test_rules_adding.py tests/test_clip_adaptive.py tests/test_clip_global_norm.py tests/test_clip_global_norm_gradient.py tests/test_apply.py tests/test_dropin_compat_v1.py tests/test_dropin_keras.py tests/test_build_tf_versions.py tests/test_xla.py tests/test_xla_keras.py tests/test_distribute.py::test_mirrored_two_replicas}"
ROOT="${MATRIX_DIR:-/tmp/tfclip-matrix}"
export TFCLIP_SOURCE_DIR="$PWD"  # tests/test_build_tf_versions.py reads build_backend/ and CMakeLists.txt there
mkdir -p "$ROOT"
rows=()
status=0
for v in "${VERSIONS[@]}"; do
  venv="$ROOT/venv-$v"
  log="$ROOT/tf-$v.log"
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  build="no"; same="-"; tests="-"; xla="-"
  if "$venv/bin/pip" install -q "tensorflow==$v.*" >"$log" 2>&1; then
    before="$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("tensorflow"))')"
    if "$venv/bin/pip" install ".[test]" >>"$log" 2>&1; then
      build="yes"
      after="$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("tensorflow"))')"
      [ "$before" = "$after" ] && same="yes ($after)" || { same="NO: $before -> $after"; status=1; }
      xla="$(cd "$ROOT" && "$venv/bin/python" -c '
import os; os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf, tfclip
try:
    tf.function(lambda x: tfclip.global_norm([x]), jit_compile=True)(tf.ones([2])); print("yes")
except Exception:
    print("no (stock fallback)")' 2>>"$log" | tail -n 1)"
      # Run from a copy of the tests (not the checkout, whose unbuilt tfclip/ would shadow the
      # installed one).
      rm -rf "$ROOT/tests-$v" && cp -r tests "$ROOT/tests-$v"
      subset="$SUBSET"
      if [ "$v" = "2.15" ]; then for t in $KERAS3_ONLY; do subset="${subset//$t/}"; done; fi
      subset="${subset//tests\//tests-$v/}"
      # shellcheck disable=SC2086
      (cd "$ROOT" && "$venv/bin/python" -m pytest -q -p no:cacheprovider -n auto $subset) >>"$log" 2>&1
      rc=$?
      tests="$(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$log" | tail -n 1 | sed 's/ in [0-9.]*s.*//; s/=//g; s/^ *//')"
      [ $rc -eq 0 ] || status=1
    else
      status=1
    fi
  else
    build="no TF $v on the index"; status=1
  fi
  rows+=("| $v | $build | $same | $tests | $xla |")
  echo "TF $v: build=$build tf-unchanged=$same tests=$tests xla=$xla (log: $log)"
done
echo
echo "| TensorFlow | builds | TF left as installed | subset | XLA kernels |"
echo "|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
exit $status
