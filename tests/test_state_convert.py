"""tfclip.convert_checkpoint (issue 47): a checkpoint moved between float32 and bfloat16
optimizer state, both ways, for each kind of checkpoint users write: Keras 3 object-based, tf_keras
legacy (slots restored when they are made), and a TF1 Saver's name-based one.

The reference is independent of the converter: the stock optimizer's float32 slots rounded to
bfloat16 by ml_dtypes (round to nearest even), and bfloat16 slots widened by NumPy."""
import os

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import tfclip
from tfclip import checkpoint as ckpt_mod

BF16 = ml_dtypes.bfloat16


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes(), (a, b)


keras = pytest.importorskip("keras", minversion="3", reason="tfclip.keras needs Keras 3")


def _keras_run(rng, opt, steps=2):
    vars_ = [keras.Variable(rng.normal(size=s).astype(np.float32), name=f"w{i}")
             for i, s in enumerate([(40,), (6, 7)])] + [keras.Variable(rng.normal(size=(3,)), name="w64")]
    for _ in range(steps):
        opt.apply([tf.constant(rng.normal(size=v.shape), dtype=v.dtype) for v in vars_], vars_)
    return vars_


def _by_leaf(opt):
    return {v.path.split("/", 1)[-1]: v for v in opt.variables}


def test_keras_stock_float32_to_bfloat16_and_back(rng, tmp_path):
    stock = keras.optimizers.Adam(0.01, amsgrad=True)
    vars_ = _keras_run(rng, stock)
    src = tf.train.Checkpoint(opt=stock, v=vars_).save(str(tmp_path / "fp32" / "c"))

    # Into bfloat16 state: a direct restore is refused by TF (the reason for the converter) ...
    opt = tfclip.keras.Adam(0.01, amsgrad=True, state_dtype="bfloat16")
    opt.build(vars_)
    target = tf.train.Checkpoint(opt=opt, v=vars_)
    with pytest.raises(tf.errors.InvalidArgumentError, match="dtype"):
        target.restore(src).assert_existing_objects_matched()
    converted = tfclip.convert_checkpoint(src, tmp_path / "bf16" / "c", like=target)
    # ... the float32 variables' six slots (m, v, vhat) converted, nothing else.
    assert len(converted) == 6
    target.restore(str(tmp_path / "bf16" / "c")).assert_consumed()
    got, want = _by_leaf(opt), _by_leaf(stock)
    assert got.keys() == want.keys()
    for leaf, v in got.items():
        w = want[leaf].numpy()
        if v.dtype == "bfloat16":
            _same_bits(v.numpy(), np.asarray(w).astype(BF16))
        else:
            _same_bits(np.asarray(v.numpy()), np.asarray(w))
    assert int(opt.iterations.numpy()) == 2
    # It trains on from there as a bf16-state run does.
    opt.apply([tf.ones_like(v) for v in vars_], vars_)

    # And back to a stock float32 checkpoint: the bf16 values widened exactly.
    bf_path = target.save(str(tmp_path / "bf16b" / "c"))
    stock2 = keras.optimizers.Adam(0.01, amsgrad=True)
    stock2.build(vars_)
    back = tf.train.Checkpoint(opt=stock2, v=vars_)
    assert len(tfclip.convert_checkpoint(bf_path, tmp_path / "back" / "c", like=back)) == 6
    back.restore(str(tmp_path / "back" / "c")).assert_consumed()
    got, want = _by_leaf(stock2), _by_leaf(opt)
    for leaf, v in got.items():
        w = np.asarray(want[leaf].numpy())
        _same_bits(np.asarray(v.numpy()), w.astype(np.float32) if w.dtype == BF16 else w)


def test_tf_keras_legacy_slots_made_after_the_restore(rng, tmp_path):
    """tf_keras legacy (OptimizerV2) makes its slots at the first step, restoring them then from
    the checkpoint (deferred restoration): the converted checkpoint restores that way too. The
    layout wanted is given as a path, written once by the bf16-state optimizer."""
    tf_keras = pytest.importorskip("tf_keras", reason="tf-keras (the optional Keras 2 package) is not installed")
    import tfclip.tf_keras as tk

    init = [rng.normal(size=(30,)).astype(np.float32), rng.normal(size=(4, 5)).astype(np.float32)]
    vars_ = [tf.Variable(x) for x in init]
    stock = tf_keras.optimizers.legacy.Adam(0.01)
    for _ in range(2):
        stock.apply_gradients(zip([tf.constant(rng.normal(size=x.shape).astype(np.float32)) for x in init], vars_))
    src = tf.train.Checkpoint(opt=stock, v=vars_).save(str(tmp_path / "fp32" / "c"))

    layout_vars = [tf.Variable(x) for x in init]
    layout_opt = tk.legacy.Adam(0.01, state_dtype="bfloat16")
    layout_opt.build(layout_vars)
    like = tf.train.Checkpoint(opt=layout_opt, v=layout_vars).save(str(tmp_path / "layout" / "c"))
    assert len(tfclip.convert_checkpoint(src, tmp_path / "bf16" / "c", like=like)) == 4

    fresh_vars = [tf.Variable(tf.zeros_like(x)) for x in init]
    opt = tk.legacy.Adam(0.01, state_dtype="bfloat16")
    # The slots do not exist yet: the restore makes them (eagerly, here), with the saved values.
    tf.train.Checkpoint(opt=opt, v=fresh_vars).restore(str(tmp_path / "bf16" / "c"))
    for v, sv in zip(fresh_vars, vars_):
        for s in ("m", "v"):
            got = opt.get_slot(v, s)
            assert got.dtype == tf.bfloat16
            _same_bits(got.numpy(), stock.get_slot(sv, s).numpy().astype(BF16))


def test_tf1_saver_name_based(rng, tmp_path):
    """A TF1 Saver's checkpoint of tfclip.compat.v1.AdamOptimizer, float32 state to bf16, through
    the command line (python -m tfclip.checkpoint OLD NEW --like LAYOUT)."""
    init = [rng.normal(size=(30,)).astype(np.float32), rng.normal(size=(4, 5)).astype(np.float32)]
    grads = [rng.normal(size=x.shape).astype(np.float32) for x in init]

    def graph(state_dtype):
        g = tf.Graph()
        with g.as_default():
            vs = [tf.compat.v1.Variable(x, name=f"w{i}") for i, x in enumerate(init)]
            opt = tfclip.compat.v1.AdamOptimizer(0.01, state_dtype=state_dtype)
            step = opt.apply_gradients([(tf.constant(gr), v) for gr, v in zip(grads, vs)])
            slots = [opt.get_slot(v, s) for v in vs for s in ("m", "v")]
            saver = tf.compat.v1.train.Saver()
        return g, step, slots, saver

    g, step, slots, saver = graph(None)
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(step)
        sess.run(step)
        src = saver.save(sess, str(tmp_path / "fp32" / "model"))
        want = sess.run(slots)
    g, step, slots, saver = graph("bfloat16")
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        like = saver.save(sess, str(tmp_path / "layout" / "model"))
        ckpt_mod.main([src, str(tmp_path / "bf16" / "model"), "--like", like])
        saver.restore(sess, str(tmp_path / "bf16" / "model"))
        got = sess.run(slots)
    for x, y in zip(got, want):
        _same_bits(x, y.astype(BF16))


def test_errors_name_what_is_wrong_and_write_nothing(rng, tmp_path):
    with pytest.raises(ValueError, match="no checkpoint at"):
        tfclip.convert_checkpoint(tmp_path / "absent", tmp_path / "out", like=tmp_path / "absent")
    a = tf.train.Checkpoint(x=tf.Variable(np.zeros(3, np.float32)), n=tf.Variable(1, dtype=tf.int64))
    src = a.save(str(tmp_path / "a" / "c"))
    b = tf.train.Checkpoint(x=tf.Variable(np.zeros(4, np.float32)), n=tf.Variable(1.0))
    with pytest.raises(ValueError) as e:
        tfclip.convert_checkpoint(src, tmp_path / "out" / "c", like=b)
    assert "x/.ATTRIBUTES/VARIABLE_VALUE: shape [3]" in str(e.value)
    assert "n/.ATTRIBUTES/VARIABLE_VALUE: int64" in str(e.value)
    assert not os.path.exists(tmp_path / "out")
    with pytest.raises(ValueError, match="share no tensor name"):
        tfclip.convert_checkpoint(src, tmp_path / "out" / "c", like=tf.train.Checkpoint(y=tf.Variable(1.0)))
    with pytest.raises(TypeError, match="like must be"):
        tfclip.convert_checkpoint(src, tmp_path / "out" / "c", like=object())
    # The command line: the message, exit status 2, nothing written.
    assert ckpt_mod.main([src, str(tmp_path / "out" / "c"), "--like", str(tmp_path / "absent")]) == 2
    assert not os.path.exists(tmp_path / "out")
    # A layout that converts nothing (an optimizer not built: its slots absent) is a copy, with a
    # warning saying so.
    with pytest.warns(UserWarning, match="is a copy"):
        assert tfclip.convert_checkpoint(src, tmp_path / "copy" / "c", like=a) == []


# ---------------------------------------------------------------- int8 state (state_dtype="int8")
import reference  # noqa: E402


def _int8_pairs(opt):
    """{codes variable's id: (absmax, signed)} from the optimizer's own record."""
    return {id(s.codes): (s.absmax, s.signed) for s in opt.tfclip_int8_slots()}


def test_keras_stock_float32_to_int8_and_back(rng, tmp_path):
    """Keras 3: a stock float32 Adam (amsgrad) checkpoint into int8 state, the absmax variables
    taking their places in the optimizer's variable list, each slot quantized as NumPy's
    reference quantizer does (with the code the rule table gives it); the run restores and
    steps; then back to a stock checkpoint: the codes dequantized exactly. Into bfloat16 state
    from int8 too (dequantized, then rounded to nearest even)."""
    stock = keras.optimizers.Adam(0.01, amsgrad=True)
    vars_ = _keras_run(rng, stock)
    src = tf.train.Checkpoint(opt=stock, v=vars_).save(str(tmp_path / "fp32" / "c"))
    opt = tfclip.keras.Adam(0.01, amsgrad=True, state_dtype="int8")
    opt.build(vars_)
    target = tf.train.Checkpoint(opt=opt, v=vars_)
    with pytest.raises(ValueError, match="like= as a tf.train.Checkpoint over the objects"):
        tfclip.convert_checkpoint(src, tmp_path / "x" / "c", like=target.write(str(tmp_path / "lay" / "c")))
    converted = tfclip.convert_checkpoint(src, tmp_path / "int8" / "c", like=target)
    assert len(converted) == 6  # m, v, vhat of the two float32 variables
    target.restore(str(tmp_path / "int8" / "c")).assert_consumed()
    pairs = _int8_pairs(opt)
    stock_slots = [getattr(stock, a) for a in ("_momentums", "_velocities", "_velocity_hats")]
    mine = [getattr(opt, a) for a in ("_momentums", "_velocities", "_velocity_hats")]
    for got, want, signed in zip(mine, stock_slots, (True, False, False)):
        for c, w in zip(got, want):
            if c.dtype != "uint8":
                _same_bits(np.asarray(c.numpy()), np.asarray(w.numpy()))
                continue
            absmax, s = pairs[id(c)]
            assert s == signed
            q, am = reference.quantize_blockwise(np.asarray(w.numpy()), signed)
            _same_bits(np.asarray(c.numpy()).ravel(), q)
            _same_bits(np.asarray(absmax.numpy()), am)
    assert int(opt.iterations.numpy()) == 2
    opt.apply([tf.ones_like(v) for v in vars_], vars_)  # it trains on from there

    # Back: src_like names the int8 side; the codes dequantized exactly.
    int8_path = target.save(str(tmp_path / "int8b" / "c"))
    stock2 = keras.optimizers.Adam(0.01, amsgrad=True)
    stock2.build(vars_)
    back = tf.train.Checkpoint(opt=stock2, v=vars_)
    with pytest.raises(ValueError, match="pass src_like="):
        tfclip.convert_checkpoint(int8_path, tmp_path / "back" / "c", like=back)
    assert len(tfclip.convert_checkpoint(int8_path, tmp_path / "back" / "c", like=back, src_like=target)) == 6
    back.restore(str(tmp_path / "back" / "c")).assert_consumed()
    for got, want, signed in zip([getattr(stock2, a) for a in ("_momentums", "_velocities", "_velocity_hats")],
                                 mine, (True, False, False)):
        for w, c in zip(got, want):
            if c.dtype == "uint8":
                absmax, _ = pairs[id(c)]
                deq = reference.dequantize_blockwise(np.asarray(c.numpy()), np.asarray(absmax.numpy()), signed)
                _same_bits(np.asarray(w.numpy()), deq.reshape(c.shape))
            else:
                _same_bits(np.asarray(w.numpy()), np.asarray(c.numpy()))

    # int8 -> bfloat16 state: dequantized, then rounded to nearest even.
    bf = tfclip.keras.Adam(0.01, amsgrad=True, state_dtype="bfloat16")
    bf.build(vars_)
    bf_target = tf.train.Checkpoint(opt=bf, v=vars_)
    assert len(tfclip.convert_checkpoint(int8_path, tmp_path / "bf" / "c", like=bf_target, src_like=target)) == 6
    bf_target.restore(str(tmp_path / "bf" / "c")).assert_consumed()
    for w, c in zip(bf._momentums, opt._momentums):
        if c.dtype == "uint8":
            absmax, _ = pairs[id(c)]
            deq = reference.dequantize_blockwise(np.asarray(c.numpy()), np.asarray(absmax.numpy()), True)
            _same_bits(np.asarray(w.numpy()), deq.reshape(c.shape).astype(BF16))


@pytest.mark.parametrize("kind", ["legacy", "new", "compat_v1"])
def test_int8_object_based_both_ways(rng, kind, tmp_path):
    """tf_keras (legacy: slots under their variable's .OPTIMIZER_SLOT, restored as they are made;
    new: absmax variables in the optimizer's list) and tfclip.compat.v1 eagerly: a float32-state
    checkpoint into int8 state and back restores the slots of the reference quantizer and its
    exact dequantization."""
    if kind == "compat_v1":
        make = lambda sd: tfclip.compat.v1.AdamOptimizer(0.01, state_dtype=sd)  # noqa: E731
    else:
        pytest.importorskip("tf_keras", reason="tf-keras (the optional Keras 2 package) is not installed")
        import tfclip.tf_keras as tk

        make = (lambda sd: tk.legacy.Adam(0.01, state_dtype=sd)) if kind == "legacy" else (  # noqa: E731
            lambda sd: tk.Adam(0.01, state_dtype=sd))
    init = [rng.normal(size=(300,)).astype(np.float32), rng.normal(size=(4, 5)).astype(np.float32)]
    vars_ = [tf.Variable(x) for x in init]
    fp = make(None)
    for _ in range(2):
        fp.apply_gradients(zip([tf.constant(rng.normal(size=x.shape).astype(np.float32)) for x in init], vars_))
    src = tf.train.Checkpoint(opt=fp, v=vars_).save(str(tmp_path / "fp32" / "c"))

    def slots(opt, vs):
        if kind == "new":
            return [getattr(opt, a)[opt._index(v)] for a in ("_momentums", "_velocities") for v in vs]
        return [opt.get_slot(v, s) for s in ("m", "v") for v in vs]

    vars8 = [tf.Variable(x) for x in init]
    q8 = make("int8")
    q8.build(vars8) if kind != "compat_v1" else q8._create_slots(vars8)
    target = tf.train.Checkpoint(opt=q8, v=vars8)
    assert len(tfclip.convert_checkpoint(src, tmp_path / "int8" / "c", like=target)) == 4
    # Restored into a fresh optimizer (legacy and TF1: the slots made and restored at the step).
    fresh = [tf.Variable(tf.zeros_like(x)) for x in init]
    opt = make("int8")
    tf.train.Checkpoint(opt=opt, v=fresh).restore(str(tmp_path / "int8" / "c"))
    opt.build(fresh) if kind == "new" else (opt._create_all_weights(fresh) if kind == "legacy"
                                            else opt._create_slots(fresh))
    pairs = _int8_pairs(opt)
    for c, w, signed in zip(slots(opt, fresh), slots(fp, vars_), (True, True, False, False)):
        absmax, s = pairs[id(c)]
        assert s == signed and c.dtype == tf.uint8
        q, am = reference.quantize_blockwise(w.numpy(), signed)
        _same_bits(c.numpy().ravel(), q)
        _same_bits(absmax.numpy(), am)
    for v, x in zip(fresh, vars_):
        _same_bits(v.numpy(), x.numpy())
    # And back to float32 state, dequantized exactly.
    int8_path = tf.train.Checkpoint(opt=opt, v=fresh).save(str(tmp_path / "int8b" / "c"))
    vars32 = [tf.Variable(x) for x in init]
    fp2 = make(None)
    fp2.build(vars32) if kind != "compat_v1" else fp2._create_slots(vars32)
    assert len(tfclip.convert_checkpoint(int8_path, tmp_path / "back" / "c",
                                         like=tf.train.Checkpoint(opt=fp2, v=vars32),
                                         src_like=tf.train.Checkpoint(opt=opt, v=fresh))) == 4
    fp3_vars = [tf.Variable(tf.zeros_like(x)) for x in init]
    fp3 = make(None)
    tf.train.Checkpoint(opt=fp3, v=fp3_vars).restore(str(tmp_path / "back" / "c"))
    fp3.build(fp3_vars) if kind == "new" else (fp3._create_all_weights(fp3_vars) if kind == "legacy"
                                               else fp3._create_slots(fp3_vars))
    for w, c, signed in zip(slots(fp3, fp3_vars), slots(opt, fresh), (True, True, False, False)):
        absmax, _ = pairs[id(c)]
        _same_bits(w.numpy(), reference.dequantize_blockwise(c.numpy(), absmax.numpy(), signed).reshape(c.shape))


def test_tf1_saver_int8_both_ways(rng, tmp_path):
    """A TF1 Saver's checkpoint of stock tf.compat.v1.train.AdamOptimizer (float32 slots, by name)
    into tfclip.compat.v1.AdamOptimizer(state_dtype="int8"), described by the optimizer itself
    (its train op built in the default graph): the Saver restores the reference quantizer's codes
    and absmax, and the run steps on; then back into the stock layout (a stock Saver checkpoint
    as like=, the int8 optimizer as src_like=): the codes dequantized exactly."""
    init = [rng.normal(size=(300,)).astype(np.float32), rng.normal(size=(4, 5)).astype(np.float32)]
    grads = [rng.normal(size=x.shape).astype(np.float32) for x in init]

    def graph(make):
        g = tf.Graph()
        with g.as_default():
            vs = [tf.compat.v1.Variable(x, name=f"w{i}", use_resource=True) for i, x in enumerate(init)]
            opt = make()
            step = opt.apply_gradients([(tf.constant(gr), v) for gr, v in zip(grads, vs)])
            slots = [opt.get_slot(v, s) for s in ("m", "v") for v in vs]
            saver = tf.compat.v1.train.Saver()
        return g, opt, step, slots, saver

    g, _, step, slots, saver = graph(lambda: tf.compat.v1.train.AdamOptimizer(0.01))
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(step)
        sess.run(step)
        src = saver.save(sess, str(tmp_path / "fp32" / "model"))
        stock_like = saver.save(sess, str(tmp_path / "stock_layout" / "model"))
        want = sess.run(slots)
    g8, opt8, step8, slots8, saver8 = graph(lambda: tfclip.compat.v1.AdamOptimizer(0.01, state_dtype="int8"))
    with tf.compat.v1.Session(graph=g8) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        lay8 = saver8.save(sess, str(tmp_path / "layout8" / "model"))
    with g8.as_default():
        with pytest.raises(ValueError, match="a path does not say each slot's absmax"):
            tfclip.convert_checkpoint(src, tmp_path / "x" / "model", like=lay8)
        assert len(tfclip.convert_checkpoint(src, tmp_path / "int8" / "model", like=opt8)) == 4
        pairs = {id(s.codes): (s.absmax, s.signed) for s in opt8.tfclip_int8_slots()}
    with tf.compat.v1.Session(graph=g8) as sess:
        saver8.restore(sess, str(tmp_path / "int8" / "model"))
        for c, w, signed in zip(slots8, want, (True, True, False, False)):
            absmax, s = pairs[id(c)]
            assert s == signed and c.dtype.base_dtype == tf.uint8
            q, am = reference.quantize_blockwise(w, signed)
            _same_bits(sess.run(c).ravel(), q)
            _same_bits(sess.run(absmax), am)
        sess.run(step8)  # it trains on from there
        int8_path = saver8.save(sess, str(tmp_path / "int8b" / "model"))
        codes = [(sess.run(c), sess.run(pairs[id(c)][0]), pairs[id(c)][1]) for c in slots8]
    with g8.as_default():
        with pytest.raises(ValueError, match="pass src_like="):
            tfclip.convert_checkpoint(int8_path, tmp_path / "y" / "model", like=stock_like)
        assert len(tfclip.convert_checkpoint(int8_path, tmp_path / "back" / "model", like=stock_like,
                                             src_like=opt8)) == 4
    with pytest.raises(ValueError, match="in the graph its train op was built in"):
        tfclip.convert_checkpoint(int8_path, tmp_path / "z" / "model", like=stock_like, src_like=opt8)
    g, _, step, slots, saver = graph(lambda: tf.compat.v1.train.AdamOptimizer(0.01))
    with tf.compat.v1.Session(graph=g) as sess:
        saver.restore(sess, str(tmp_path / "back" / "model"))
        for s, (c, absmax, signed) in zip(slots, codes):
            _same_bits(sess.run(s), reference.dequantize_blockwise(c, absmax, signed).reshape(c.shape))
        sess.run(step)


def test_int8_errors_and_other_uint8_variables(rng, tmp_path):
    """A layout whose counterpart is missing is an error naming it, and nothing is written; a
    src_like holding no tfclip optimizer with int8 state is refused; a uint8 variable of the
    model's own (not int8 state) is copied as it is."""
    opt = tfclip.keras.Adam(0.01, state_dtype="int8")
    vars_ = _keras_run(rng, opt, steps=1)
    path = tf.train.Checkpoint(opt=opt, v=vars_).save(str(tmp_path / "a" / "c"))
    stock = keras.optimizers.Adam(0.01)
    stock.build(vars_[:2])  # (one variable fewer: its slots have no counterpart)
    with pytest.raises(ValueError, match="not in the layout wanted, so not carried over"):
        tfclip.convert_checkpoint(path, tmp_path / "out" / "c", like=tf.train.Checkpoint(opt=stock, v=vars_[:2]),
                                  src_like=tf.train.Checkpoint(opt=opt, v=vars_))
    assert not os.path.exists(tmp_path / "out")
    with pytest.raises(ValueError, match="holds no tfclip optimizer with int8 state"):
        tfclip.convert_checkpoint(path, tmp_path / "out" / "c", like=tf.train.Checkpoint(opt=stock, v=vars_[:2]),
                                  src_like=tf.train.Checkpoint(v=vars_, o=tf.Variable(np.zeros(3, np.uint8))))
    assert not os.path.exists(tmp_path / "out")
    # A model's own uint8 variable beside int8 state, into a stock float32 layout: copied.
    flag = tf.Variable(np.arange(5, dtype=np.uint8))
    src = tf.train.Checkpoint(opt=opt, v=vars_, flag=flag).save(str(tmp_path / "b" / "c"))
    back = keras.optimizers.Adam(0.01)
    back.build(vars_)
    flag2 = tf.Variable(np.zeros(5, np.uint8))
    like = tf.train.Checkpoint(opt=back, v=vars_, flag=flag2)
    tfclip.convert_checkpoint(src, tmp_path / "fp" / "c", like=like,
                              src_like=tf.train.Checkpoint(opt=opt, v=vars_, flag=flag))
    like.restore(str(tmp_path / "fp" / "c")).assert_consumed()
    _same_bits(flag2.numpy(), np.arange(5, dtype=np.uint8))
