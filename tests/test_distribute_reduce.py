"""`reduce_dtype` (tfclip/_engine/reduce.py): the gradients summed across replicas in 16 bits.

Under MirroredStrategy on 2 logical CPUs and MultiWorkerMirroredStrategy with 2 worker
processes (tests/harness/reduce_check.py, in fresh processes), each front door's copies must hold
the bits of one device given the sum a 16-bit collective makes (each replica's gradient rounded,
the two added and rounded once), and differ from the float32-reduced run, which must hold the
float32 sum's. In this process: the refusals, the one-replica no-op and the config."""
import os

import numpy as np
import pytest
import tensorflow as tf

import tfclip
from procs import run_harness, run_workers, shared_once

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness", "reduce_check.py")
CASES = ["keras_bfloat16", "keras_float16", "keras_float32", "keras_shard_bfloat16", "keras_shard_float32",
         "tf_keras_bfloat16", "tf_keras_float32", "rules_bfloat16", "rules_float16", "rules_float32",
         "rules_shard_bfloat16", "rules_shard_float32"]


def _check(r, case):
    n = 0
    while f"{case}_got_{n}" in r.files:
        got, want = r[f"{case}_got_{n}"], r[f"{case}_want_{n}"]
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"{case} variable {n}")
        n += 1
    assert n == 2, case
    if not case.endswith("float32"):  # the 16-bit sum is another sum than float32's
        wide = case.rsplit("_", 1)[0] + "_float32"
        assert any(not np.array_equal(r[f"{case}_got_{i}"], r[f"{wide}_got_{i}"]) for i in range(n)), case


def _mirrored(folder):
    run_harness([HARNESS, "mirrored", str(folder / "m.npz")], folder, timeout=600)
    return str(folder / "m.npz")


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
    return np.load(shared_once(tmp_path_factory, "reduce_mirrored", _mirrored))  # (once per run, procs.py)


def _two_workers(folder):
    run_workers(lambda i: [HARNESS, "worker", str(folder / f"w{i}.npz")], folder, timeout=600)
    return [str(folder / f"w{i}.npz") for i in range(2)]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    return [np.load(f) for f in shared_once(tmp_path_factory, "reduce_workers", _two_workers)]


@pytest.mark.parametrize("case", CASES)
def test_mirrored_copies_hold_the_16_bit_sums_step(mirrored, case):
    assert int(mirrored["replicas"]) == 2
    _check(mirrored, case)


@pytest.mark.parametrize("case", CASES)
def test_two_worker_processes_hold_the_16_bit_sums_step(workers, case):
    for w in workers:
        assert int(w["replicas"]) == 2
        _check(w, case)
    for i in range(2):  # and the same weights in both processes
        np.testing.assert_array_equal(workers[0][f"{case}_got_{i}"], workers[1][f"{case}_got_{i}"])


def test_a_variable_of_another_dtype_is_refused_by_name(mirrored):
    msg = str(mirrored["refusal"])
    assert "reduce_dtype='bfloat16'" in msg and "variable 'wide" in msg and "is float64" in msg, msg


@pytest.mark.parametrize("bad", ["int8", "float64", tf.float64, 16, "bf16"])
def test_a_bad_reduce_dtype_is_refused(bad):
    for make in (lambda: tfclip.keras.Adam(reduce_dtype=bad), lambda: tfclip.rules.Adam(0.1, reduce_dtype=bad),
                 lambda: tfclip.tf_keras.Adam(reduce_dtype=bad)):
        with pytest.raises(ValueError, match="reduce_dtype must be None, 'bfloat16' or 'float16'"):
            make()


def test_one_replica_casts_nothing():
    """No strategy: nothing crosses a link, the float32 gradient is applied as it is."""
    g = tf.constant(np.linspace(-1, 1, 7).astype(np.float32) * (1 + 2.0 ** -12))
    out = []
    for rd in (None, "bfloat16"):
        v = tf.Variable(np.ones(7, np.float32))
        tfclip.keras.Adam(0.1, global_clipnorm=1.0, reduce_dtype=rd).apply_gradients([(g, v)])
        out.append(v.numpy())
    np.testing.assert_array_equal(out[0].view(np.uint32), out[1].view(np.uint32))


def test_the_config_keeps_it():
    opt = tfclip.keras.Adam(reduce_dtype=tf.bfloat16)
    assert opt.reduce_dtype == "bfloat16" and opt.get_config()["reduce_dtype"] == "bfloat16"
    assert tfclip.keras.Adam.from_config(opt.get_config()).reduce_dtype == "bfloat16"
    assert "reduce_dtype" not in tfclip.keras.Adam(reduce_dtype="float32").get_config()
    t = tfclip.tf_keras.Adam(reduce_dtype="float16")
    assert tfclip.tf_keras.Adam.from_config(t.get_config()).reduce_dtype == "float16"
    assert tfclip.rules.Adam(0.1, reduce_dtype="bfloat16").reduce_dtype == "bfloat16"
