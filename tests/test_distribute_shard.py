"""shard_state=True (tfclip/_engine/shard.py), tfclip.keras and tfclip.tf_keras: each replica keeps the optimizer state of its share of
the variables, and the step gives the unsharded step's bits.

tests/harness/sharded_check.py runs in a fresh process (MirroredStrategy over 2 logical CPUs is
configured at start-up) and steps every case three ways: sharded on 2 replicas, unsharded
(mirrored slots) on 2 replicas, and on one device given the summed gradient (the same one float
addition the all-reduce makes). It checks after every run that every copy of every mirrored
variable holds the same bits."""
import os

import numpy as np
import pytest

import tfclip
from procs import run_harness, run_workers, shared_once
from tfclip._engine import shard as _shard

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness", "sharded_check.py")
CASES = ["adam", "adam_amsgrad", "adamw_excluded", "sgd_nesterov", "rmsprop", "adagrad", "adadelta", "adamax",
         "nadam", "lion", "ftrl", "lamb", "adafactor", "adafactor_factored", "zclip", "agc", "int8", "bf16_state",
         "bf16_vars", "muon", "muon_agc", "tfk_adam", "tfk_adamw", "tfk_adafactor", "tfk_agc", "tfk_int8",
         # tfclip.rules through fused_clip_apply in a replica context
         "rules_adam", "rules_nadam", "rules_agc", "rules_zclip", "rules_int8", "rules_adafactor"]


def _harness(folder):
    run_harness([HARNESS, str(folder / "s.npz")], folder)
    return str(folder / "s.npz")


@pytest.fixture(scope="module")
def r(tmp_path_factory):
    return np.load(shared_once(tmp_path_factory, "shard", _harness))  # (once per run, procs.py)


def _bits(a):
    return np.asarray(a).tobytes()


@pytest.mark.parametrize("case", CASES)
def test_sharded_step_is_the_unsharded_and_the_one_device_step_bit_for_bit(r, case):
    assert _bits(r[f"{case}_sharded_vars"]) == _bits(r[f"{case}_mirrored_vars"])
    assert _bits(r[f"{case}_sharded_vars"]) == _bits(r[f"{case}_one_vars"])
    assert _bits(r[f"{case}_sharded_slots"]) == _bits(r[f"{case}_mirrored_slots"])
    # The clip's norm is the global norm of every gradient, not of the replica's share.
    assert r[f"{case}_sharded_norm"] == r[f"{case}_one_norm"]
    assert _bits(r[f"{case}_sharded_tnorms"]) == _bits(r[f"{case}_one_tnorms"])
    # (the rules differ: a case is not Adam over again, but tf_keras's Adam and tfclip.rules.Adam
    # are Keras 3's)
    assert not np.array_equal(r[f"{case}_sharded_vars"], r["adam_sharded_vars"]) or case in (
        "adam", "tfk_adam", "rules_adam")


@pytest.mark.parametrize("case", CASES)
def test_each_replica_holds_its_share_of_the_state(r, case):
    sharded, mirrored = r[f"{case}_sharded_bytes"], r[f"{case}_mirrored_bytes"]
    assert len(sharded) == len(mirrored) == 2
    assert mirrored[0] == mirrored[1] > 0  # unsharded: a whole copy on each replica
    # sharded: one copy in all, split; scalar state (Nadam's u_product, an adaptive clip's
    # statistics) stays mirrored, a few bytes on each replica
    assert mirrored[0] <= sharded.sum() <= mirrored[0] + 64
    owners = r[f"{case}_sharded_owners"]
    assert sorted(set(owners)) == [0, 1]
    # Whole variables by bytes: each replica within half the largest variable of an even split.
    largest = 200 * 40 / (200 * 40 + 40 + 40 * 150 + 150 + 30 * 60 + 64 * 16)
    assert max(sharded) / sharded.sum() <= 0.5 + largest / 2


@pytest.mark.parametrize("agc", ["agc", "tfk_agc", "rules_agc", "muon_agc"])
def test_agc_counts_are_gathered(r, agc):
    np.testing.assert_array_equal(r[f"{agc}_sharded_units"], r[f"{agc}_one_units"])
    assert r[f"{agc}_sharded_units"].sum() > 0


@pytest.mark.parametrize("front", ["nan", "rules_nan"])
def test_a_nonfinite_step_is_skipped_on_every_replica(r, front):
    # A NaN in one variable's gradient at step 3 of 4: skipped on both replicas, as unsharded
    # (Keras's Adam, and tfclip.rules.Adam through fused_clip_apply, whose counter stays put).
    assert int(r[f"{front}_sharded_skipped"]) == int(r[f"{front}_mirrored_skipped"]) == 1
    assert _bits(r[f"{front}_sharded_vars"]) == _bits(r[f"{front}_mirrored_vars"])
    assert _bits(r[f"{front}_sharded_slots"]) == _bits(r[f"{front}_mirrored_slots"])


def test_eager_steps_equal_traced_ones(r):
    assert _bits(r["eager_sharded_vars"]) == _bits(r["adam_sharded_vars"])
    assert _bits(r["eager_rules_sharded_vars"]) == _bits(r["rules_adam_sharded_vars"])


def test_stochastic_rounding_draws_per_op_position(r):
    """bfloat16 variables with stochastic_rounding: the draw depends on a variable's position in
    its op (csrc/core/rounding.h), which sharding changes, so the bits are not the unsharded
    run's; every copy is the same (checked in the harness) and the weights stay within a few
    bfloat16 ulps of the unsharded run's."""
    s, m = r["rounding_sharded_vars"], r["rounding_mirrored_vars"]
    assert _bits(r["rounding_sharded_slots"]) == _bits(r["rounding_mirrored_slots"])
    np.testing.assert_allclose(s, m, rtol=2 ** -5, atol=2 ** -12)


def test_checkpoints_keep_the_stock_layout_both_ways(r):
    # sharded -> stock keras.optimizers.Adam on one device: every slot restored (assert_consumed)
    assert _bits(r["ckpt_sharded_slots"]) == _bits(r["ckpt_into_stock_slots"])
    # sharded -> tfclip on one device, and stock mirrored -> sharded: each continues to the bits of
    # the uninterrupted sharded run
    assert _bits(r["ckpt_sharded_to_one"]) == _bits(r["ckpt_want"])
    assert _bits(r["ckpt_mirrored_to_sharded"]) == _bits(r["ckpt_want"])
    # model.fit: sharded equals unsharded; the .keras file loads without a strategy, shard_state kept
    assert _bits(r["fit_sharded"]) == _bits(r["fit_unsharded"])
    assert _bits(r["fit_loaded"]) == _bits(r["fit_sharded"])
    assert str(r["fit_loaded_config"]) == "True"
    # tf_keras: sharded tfclip.tf_keras.Adam -> stock tf_keras Adam on one device
    assert _bits(r["ckpt_tfk_into_stock"]) == _bits(r["ckpt_tfk_sharded"])
    assert sorted(set(r["fit_owners"])) == [0, 1]


def test_refusals_name_what_is_wrong(r):
    not_bool, cross = [str(m) for m in r["refusals"]]
    assert "shard_state must be True or False, got 1" in not_bool
    assert "inside strategy.run" in cross
    assert bool(r["refusal_unchanged"])
    not_bool, cross = [str(m) for m in r["rule_refusals"]]  # tfclip.rules, fused_clip_apply
    assert "shard_state must be True or False, got 1" in not_bool
    assert "Adam(shard_state=True): fused_clip_apply steps inside strategy.run" in cross
    assert bool(r["rule_refusal_unchanged"])


@pytest.mark.parametrize("edge", ["edge_one_var_rule", "edge_one_var_keras", "edge_use_norm", "edge_int8_sparse"])
def test_edges_give_the_unsharded_bits(r, edge):
    """A replica that owns nothing (one variable: tfclip.rules and Keras, against unsharded and one
    device); a `use_norm` each replica gives differently (the first replica's counts, as
    unsharded: a clip from each replica's own would differ); int8 state with IndexedSlices
    gradients (densified before the norm pass, as unsharded). Each row: weights, then the norm."""
    rows = r[edge]
    for row in rows[1:]:
        assert _bits(rows[0]) == _bits(row)


def test_a_sharded_rules_variables_restore_on_one_device(r):
    """tfclip.rules: `rule.variables` saved sharded restore into an unsharded rule on one device
    (assert_consumed), which carries on to the uninterrupted sharded run's bits."""
    assert _bits(r["ckpt_rule_sharded_to_one"]) == _bits(r["ckpt_rule_want"])


def test_owners_balance_whole_variables_by_bytes():
    assert _shard.owners([8000, 40, 6000, 150, 1800, 1024], 2) == [0, 0, 1, 0, 1, 1]
    assert _shard.owners([4, 4, 4, 4], 2) == [0, 1, 0, 1]
    assert _shard.owners([10, 1], 3) == [0, 1]
    assert _shard.owners([], 2) == []


@pytest.mark.parametrize("door", ["keras", "tf_keras", "rules"])
@pytest.mark.parametrize("bad", [1, "yes", None])
def test_every_front_door_refuses_a_shard_state_that_is_not_a_bool(door, bad):
    """One check (tfclip/_engine/shard.py, check) for the Keras 3 and tf_keras optimizers and the rules."""
    import tfclip.tf_keras

    make = {"keras": tfclip.keras.Adam, "tf_keras": tfclip.tf_keras.Adam, "rules": tfclip.rules.Adam}[door]
    with pytest.raises(TypeError, match=f"shard_state must be True or False, got {bad!r}"):
        make(0.1, shard_state=bad)


def test_one_replica_keeps_the_stock_layout():
    """Without a strategy (or with one replica) shard_state changes nothing."""
    import keras

    v = keras.Variable(np.ones((3, 2), "float32"))
    opt = tfclip.keras.Adam(0.1, shard_state=True)
    ref = tfclip.keras.Adam(0.1)
    w = keras.Variable(np.ones((3, 2), "float32"))
    for _ in range(2):
        opt.apply_gradients([(np.full((3, 2), 0.5, "float32"), v)])
        ref.apply_gradients([(np.full((3, 2), 0.5, "float32"), w)])
    assert opt.state_owners is None
    np.testing.assert_array_equal(v.numpy(), w.numpy())
    assert opt.get_config()["shard_state"] is True
    assert "shard_state" not in ref.get_config()


def _two_workers(folder):
    run_workers(lambda i: [HARNESS, str(folder / f"w{i}.npz"), "worker"], folder)
    return [str(folder / f"w{i}.npz") for i in range(2)]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """2 MultiWorkerMirroredStrategy processes on localhost, one replica each (once per run)."""
    return [np.load(f) for f in shared_once(tmp_path_factory, "shard_workers", _two_workers)]


@pytest.mark.parametrize("case", ["adam", "adafactor", "agc", "muon", "tfk_adam", "tfk_adafactor"])
def test_two_worker_processes_each_hold_half_and_train_to_the_same_bits(workers, case):
    for i, w in enumerate(workers):
        assert int(w["task"]) == i and int(w["replicas"]) == 2
        assert _bits(w[f"{case}_sharded_vars"]) == _bits(w[f"{case}_mirrored_vars"])
        assert _bits(w[f"{case}_sharded_vars"]) == _bits(w[f"{case}_one_vars"])
        assert w[f"{case}_sharded_norm"] == w[f"{case}_one_norm"]
        assert _bits(w[f"{case}_sharded_tnorms"]) == _bits(w[f"{case}_one_tnorms"])
    # each process keeps the slots of its replica's share: together one copy, split
    held = [int(w[f"{case}_sharded_bytes"].sum()) for w in workers]
    whole = int(workers[0][f"{case}_mirrored_bytes"].sum())
    assert whole <= sum(held) <= whole + 64 and max(held) < 0.55 * whole
    assert _bits(workers[0][f"{case}_sharded_vars"]) == _bits(workers[1][f"{case}_sharded_vars"])
    if case == "agc":
        for w in workers:
            np.testing.assert_array_equal(w["agc_sharded_units"], w["agc_one_units"])


def test_two_worker_processes_reduce_scatter_skip_and_sum_in_bfloat16_as_unsharded(workers):
    """The sharded step across processes reduce-scatters (each replica receives only its own
    variables' sums): a NaN gradient skips the step on every replica, and with reduce_dtype the
    bfloat16 sums give the unsharded step's bits."""
    for w in workers:
        assert int(w["scatters"]) == 2 * 4  # (two sharded runs of 4 traced steps each)
        assert int(w["nan_sharded_skipped"]) == int(w["nan_mirrored_skipped"]) == 1
        assert _bits(w["nan_sharded_vars"]) == _bits(w["nan_mirrored_vars"])
        assert _bits(w["bf16_reduce_sharded_vars"]) == _bits(w["bf16_reduce_mirrored_vars"])
        assert w["bf16_reduce_sharded_norm"] == w["bf16_reduce_mirrored_norm"]
        assert _bits(w["bf16_reduce_sharded_tnorms"]) == _bits(w["bf16_reduce_mirrored_tnorms"])
    assert _bits(workers[0]["bf16_reduce_sharded_vars"]) == _bits(workers[1]["bf16_reduce_sharded_vars"])
    for w in workers:  # every front door's sharded step reduce-scatters: one per traced step (4;
        # a rule makes its slots in its first step, which tf.function then traces twice)
        for case in ("adam", "adafactor", "agc", "muon", "tfk_adam", "tfk_adafactor", "int8", "bf16_state",
                     "tfk_int8", "rules_adam", "rules_int8"):
            assert int(w[f"{case}_sharded_scatters"]) == (5 if case.startswith("rules_") else 4), case
            if f"{case}_mirrored_scatters" in w:  # (unsharded across processes: the all-reduce)
                assert int(w[f"{case}_mirrored_scatters"]) == 0, case
    for w in workers:  # (the collectives in pieces of 777 elements)
        for case in ("adam", "agc"):
            assert _bits(w[f"{case}_pieces_vars"]) == _bits(w[f"{case}_one_vars"])
            assert _bits(w[f"{case}_pieces_tnorms"]) == _bits(w[f"{case}_one_tnorms"])
        np.testing.assert_array_equal(w["agc_pieces_units"], w["agc_one_units"])
        for case in ("adam", "tfk_adam"):
            assert _bits(w[f"{case}_pieces_unsharded_vars"]) == _bits(w[f"{case}_one_vars"])
            assert _bits(w[f"{case}_pieces_unsharded_slots"]) == _bits(w[f"{case}_mirrored_slots"])


def test_two_worker_processes_unsharded_sum_in_pieces_as_tfs_all_reduce(workers):
    """Unsharded across processes every Keras 3 and tf_keras optimizer and tfclip.rules sum the gradients with
    tfclip's all-reduce in pieces (tfclip/_engine/collectives.py: an all-to-all, a sum in replica
    order, an all-gather), once per traced step, the sharded step never; on 2 replicas its sums
    are TF's own ring all-reduce's bits, in float32, bfloat16 and float16, in one piece or many."""
    for w in workers:
        for case in ("adam", "adafactor", "agc", "muon", "tfk_adam", "tfk_adafactor"):
            assert int(w[f"{case}_mirrored_reduces"]) == 4, case
            assert int(w[f"{case}_sharded_reduces"]) == 0, case
            assert int(w[f"{case}_one_reduces"]) == 0, case
        # (tf_keras with a variable given no gradient: the others summed, it left alone)
        assert int(w["tfk_none_mirrored_reduces"]) == 4 and int(w["tfk_none_one_reduces"]) == 0
        assert _bits(w["tfk_none_mirrored_vars"]) == _bits(w["tfk_none_one_vars"])
        assert _bits(w["tfk_none_mirrored_vars"]) != _bits(w["tfk_adam_one_vars"])
        # (tfclip.rules: one per traced step, 5, as its sharded step's reduce-scatters)
        assert int(w["rules_adam_mirrored_reduces"]) == 5 and int(w["rules_adam_sharded_reduces"]) == 0
        for piece in (1 << 21, 7):  # (float32, bfloat16 and float16 in one call)
            key = f"ring_{piece}"
            assert w[key + "_kinds"].all() and w[key + "_kinds"].size == 15, key
            assert w[key + "_tf"].size == 3 * (3 * 5 + 1 + 0 + 1000 + 8)
            assert np.all(w[key + "_tf"][:1024] != w[key + "_tf"][1024:2048])  # (bfloat16 rounds: apart)
            assert _bits(w[key + "_ours"]) == _bits(w[key + "_tf"]), key
    assert _bits(workers[0]["ring_7_ours"]) == _bits(workers[1]["ring_7_ours"])


@pytest.mark.parametrize("case", ["int8", "bf16_state", "tfk_int8"])
def test_two_worker_processes_keep_narrow_state_sharded(workers, case):
    """int8 and bfloat16 optimizer state across worker processes: sharded, each process holds
    half and the weights are one device's bits."""
    for w in workers:
        assert _bits(w[f"{case}_sharded_vars"]) == _bits(w[f"{case}_one_vars"])
        assert _bits(w[f"{case}_sharded_tnorms"]) == _bits(w[f"{case}_one_tnorms"])
    held = [int(w[f"{case}_sharded_bytes"].sum()) for w in workers]
    whole = int(workers[0][f"{case}_one_bytes"].sum())
    assert whole <= sum(held) <= whole + 64 and max(held) < 0.55 * whole


def test_two_worker_processes_refuse_narrow_state_mirrored(workers):
    """Unsharded, MultiWorkerMirroredStrategy would broadcast the uint8 / bfloat16 slots' initial
    values with a collective TF has no such kernel for (TF's own error names an attr 'T'): the
    build (tfclip.rules: the first slot) refuses first, naming the dtype, why, and shard_state=True."""
    for w in workers:
        msgs = [str(m) for m in w["narrow_mirrored_refusals"]]
        assert len(msgs) == 4  # Keras 3 int8, Keras 3 bfloat16, tf_keras int8, tfclip.rules int8
        for m, dtype, kernel in zip(msgs, ("int8", "bfloat16", "int8", "int8"), ("uint8", "bfloat16", "uint8", "uint8")):
            assert f"state_dtype={dtype!r} under MultiWorkerMirroredStrategy (2 worker processes) needs " \
                   "shard_state=True" in m, m
            assert f"no {kernel} kernel" in m, m


def test_two_worker_processes_shard_a_rule(workers):
    """tfclip.rules through fused_clip_apply across 2 worker processes: each keeps half the state
    (a slot kept by the other a RemoteSlot), the unsharded run's and one device's bits; with int8
    state too (which unsharded cannot cross processes)."""
    for case, against in (("rules_adam", ("mirrored", "one")), ("rules_int8", ("one",))):
        for w in workers:
            for run in against:
                assert _bits(w[f"{case}_sharded_vars"]) == _bits(w[f"{case}_{run}_vars"]), (case, run)
            assert _bits(w[f"{case}_sharded_tnorms"]) == _bits(w[f"{case}_one_tnorms"])
            assert w[f"{case}_sharded_norm"] == w[f"{case}_one_norm"]
        held = [int(w[f"{case}_sharded_bytes"].sum()) for w in workers]
        whole = int(workers[0][f"{case}_one_bytes"].sum())
        assert whole <= sum(held) <= whole + 64 and max(held) < 0.55 * whole, (case, held, whole)


def test_two_worker_rule_checkpoint_is_the_stock_layout_and_resumes(workers):
    """Every worker saves the sharded rule's `variables`; the chief's file restores whole into an
    unsharded rule on one device (assert_consumed; the unsharded run's slots) and into a fresh
    sharded rule, which carries on to the uninterrupted bits."""
    for w in workers:
        assert int(w["rules_remote_slots"]) > 0
        assert _bits(w["rules_ckpt_into_one_slots"]) == _bits(w["rules_ckpt_mirrored_slots"])
        assert _bits(w["rules_ckpt_resumed"]) == _bits(w["rules_ckpt_want"])


def test_two_worker_processes_where_one_keeps_all_of_a_rules_state(workers):
    """One variable: worker 0 owns all of the rule's state; the step gives one device's bits, and
    every worker's checkpoint makes the same broadcasts (each keeps an exchange), so the chief's
    file holds the slots and restores on one device (the counter and slots of that device's run)."""
    for w in workers:
        assert _bits(w["one_var"][0]) == _bits(w["one_var"][1])
        assert _bits(w["one_var_slots"][0]) == _bits(w["one_var_slots"][1])


def test_two_worker_checkpoint_is_the_stock_layout_and_resumes(workers):
    for w in workers:
        # every worker saved; the chief's file holds every slot, both workers' shares: stock
        # keras.optimizers.Adam on one device restores it whole (assert_consumed) with the
        # unsharded run's slots, and a fresh sharded optimizer resumes to the uninterrupted bits
        assert _bits(w["ckpt_into_stock_slots"]) == _bits(w["ckpt_mirrored_slots"])
        assert _bits(w["ckpt_into_stock_vars"]) == _bits(w["ckpt_sharded_vars"])
        assert _bits(w["ckpt_resumed"]) == _bits(w["ckpt_want"])
        assert int(w["remote_slots"]) > 0
        assert "in another worker process" in str(w["remote_numpy"])
        # tf_keras: the chief's file of a sharded tfclip.tf_keras.Adam into stock tf_keras Adam
        assert _bits(w["ckpt_tfk_into_stock"]) == _bits(w["ckpt_tfk_mirrored"])
