"""An apply op on a range of a variable (`var_offsets`, csrc/core/apply_op.h: a replica's share of
a variable split across replicas): each range's step, given the whole gradient's norm, writes the
whole-variable step's bits into its range of the variable and into its own slots, and nothing
outside its range; int8 state's blocks, starting on a block boundary, the same codes and absmax.
What a range cannot take is refused by name, writing nothing."""
import numpy as np
import pytest
import tensorflow as tf

from tfclip._engine import opcall as _opcall

HP = {"lr": 0.01, "momentum": 0.9, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7, "weight_decay": 0.0,
      "step": 3.0}
SHAPE = (40, 25)  # 1,000 elements: ranges [0, 512) and [512, 1000), int8's blocks of 256 aligned


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=SHAPE).astype("float32"), rng.normal(size=SHAPE).astype("float32")


def _hp(rule):
    return {n: HP[n] for n in _opcall.RULES[rule]["hparams"] if n in HP}


def _step(rule, var, slots, grad, norm, offsets=None, absmax=(), **kw):
    common = dict(indices=[], sparse=[], clip=0.5, use_norm=tf.constant(norm, tf.float64), iterations=[],
                  clip_mode="global_norm", nonfinite="skip", use_given_norm=True)
    common.update(kw)
    if offsets is not None:
        common["var_offsets"] = offsets
    return _opcall.apply(rule, var, slots, grad, _hp(rule), absmax=list(absmax), **common)


@pytest.mark.parametrize("rule", ["adam", "momentum", "sgd"])
def test_ranges_step_the_whole_variables_bits(rule):
    w0, g = _problem()
    norm = float(np.sqrt(np.sum(np.square(g.astype(np.float64)))))
    names = _opcall.RULES[rule]["slots"][:_opcall.RULES[rule]["min_slots"]]
    whole = tf.Variable(w0)
    whole_slots = {s: tf.Variable(np.full(SHAPE, 0.1, "float32")) for s in names}
    _step(rule, [whole.handle], {s: [v.handle] for s, v in whole_slots.items()}, [tf.constant(g)], norm)
    split = tf.Variable(w0)
    flat_g = g.ravel()
    pieces = [(0, 512), (512, 1000)]
    piece_slots = [{s: tf.Variable(np.full([b - a], 0.1, "float32")) for s in names} for a, b in pieces]
    for (a, b), sl in zip(pieces, piece_slots):
        out = _step(rule, [split.handle], {s: [v.handle] for s, v in sl.items()}, [tf.constant(flat_g[a:b])], norm,
                    offsets=[a])
        assert bool(out.applied.numpy())
    assert split.numpy().tobytes() == whole.numpy().tobytes()
    assert not np.array_equal(whole.numpy(), w0)
    for s in names:
        joined = np.concatenate([sl[s].numpy() for sl in piece_slots])
        assert joined.tobytes() == whole_slots[s].numpy().ravel().tobytes(), s


def test_a_range_writes_nothing_outside_it_and_mixes_with_whole_variables():
    w0, g = _problem(1)
    other0, other_g = _problem(2)
    norm = 3.0
    v, other = tf.Variable(w0), tf.Variable(other0)
    m_piece, m_other = tf.Variable(np.zeros([300], "float32")), tf.Variable(np.zeros(SHAPE, "float32"))
    _step("momentum", [v.handle, other.handle], [[m_piece.handle, m_other.handle]],
          [tf.constant(g.ravel()[256:556]), tf.constant(other_g)], norm, offsets=[256, -1])
    after = v.numpy().ravel()
    assert after[:256].tobytes() == w0.ravel()[:256].tobytes()
    assert after[556:].tobytes() == w0.ravel()[556:].tobytes()
    assert np.all(after[256:556] != w0.ravel()[256:556])
    ref_v, ref_other = tf.Variable(w0), tf.Variable(other0)
    ref_m, ref_m_other = tf.Variable(np.zeros(SHAPE, "float32")), tf.Variable(np.zeros(SHAPE, "float32"))
    _step("momentum", [ref_v.handle, ref_other.handle], [[ref_m.handle, ref_m_other.handle]],
          [tf.constant(g), tf.constant(other_g)], norm)
    assert after[256:556].tobytes() == ref_v.numpy().ravel()[256:556].tobytes()
    assert m_piece.numpy().tobytes() == ref_m.numpy().ravel()[256:556].tobytes()
    assert other.numpy().tobytes() == ref_other.numpy().tobytes()


def test_int8_state_ranges_on_block_boundaries_keep_the_whole_variables_codes():
    w0, g = _problem(3)
    norm = float(np.sqrt(np.sum(np.square(g.astype(np.float64)))))

    def int8_slots(n):
        blocks = -(-n // 256)
        return ([tf.Variable(np.full([n], 127, "uint8")), tf.Variable(np.full([n], 0, "uint8"))],
                [tf.Variable(np.zeros([blocks], "float32")), tf.Variable(np.zeros([blocks], "float32"))])

    whole = tf.Variable(w0)
    absmax = int8_slots(1000)[1]
    m, v = tf.Variable(np.full(SHAPE, 127, "uint8")), tf.Variable(np.full(SHAPE, 0, "uint8"))
    for _ in range(2):
        _step("adam", [whole.handle], [[m.handle], [v.handle]], [tf.constant(g)], norm,
              absmax=[a.handle for a in absmax])
    split = tf.Variable(w0)
    pieces = [(0, 512), (512, 1000)]
    state = [int8_slots(b - a) for a, b in pieces]
    for _ in range(2):
        for (a, b), ((pm, pv), pa) in zip(pieces, state):
            _step("adam", [split.handle], [[pm.handle], [pv.handle]], [tf.constant(g.ravel()[a:b])], norm,
                  offsets=[a], absmax=[x.handle for x in pa])
    assert split.numpy().tobytes() == whole.numpy().tobytes()
    for k, slot in enumerate((m, v)):
        assert np.concatenate([s[0][k].numpy() for s in state]).tobytes() == slot.numpy().ravel().tobytes()
        assert np.concatenate([s[1][k].numpy() for s in state]).tobytes() == absmax[k].numpy().tobytes()
    assert len(set(m.numpy().ravel().tolist())) > 10  # (the codes moved off their start)


def _refused(match, rule="adam", offsets=(512,), grad_size=488, **kw):
    w0, _ = _problem(4)
    var = tf.Variable(w0)
    names = _opcall.RULES[rule]["slots"][:_opcall.RULES[rule]["min_slots"]]
    slots = {s: [tf.Variable(np.zeros([grad_size], "float32")).handle] for s in names}
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError, TypeError), match=match):
        _step(rule, [var.handle], slots, [tf.constant(np.ones([grad_size], "float32"))], 1.0,
              offsets=list(offsets), **kw)
    assert var.numpy().tobytes() == w0.tobytes()  # (nothing written)


def test_what_a_range_cannot_take_is_refused_by_name():
    _refused(r"grads\[0\] has 489 elements from var_offsets\[0\] = 512 but .* has 1000", grad_size=489)
    _refused(r"var_offsets has 2 entries for 1 variables", offsets=(0, 512))
    _refused(r"var_offsets\[0\] is -2", offsets=(-2,))
    _refused(r"rule 'lamb' cannot step a range of a variable: its trust ratio is a whole variable's", rule="lamb")
    _refused(r"clip_mode 'norm' clips by a whole gradient's norm", clip_mode="norm", use_given_norm=False)
    _refused(r"clip_mode 'agc' clips by a whole variable's units", clip_mode="agc", use_given_norm=False)
    w0, _ = _problem(5)
    var = tf.Variable(w0)
    slot = tf.Variable(np.zeros([10], "float32"))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"its range from var_offsets\[0\] = 0: \[488\]"):
        _step("momentum", [var.handle], [[slot.handle]], [tf.constant(np.ones([488], "float32"))], 1.0,
              offsets=[0])
    assert var.numpy().tobytes() == w0.tobytes()


def test_a_sparse_gradient_takes_no_range():
    w0, _ = _problem(6)
    var, slot = tf.Variable(w0), tf.Variable(np.zeros(SHAPE, "float32"))
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=r"a range of a variable takes a dense"):
        _step("momentum", [var.handle], [[slot.handle]], [tf.constant(np.ones([2, 25], "float32"))], 1.0,
              offsets=[0], indices=[tf.constant([1, 3])], sparse=[0])
    assert var.numpy().tobytes() == w0.tobytes()


def test_xla_refuses_a_range_by_name():
    w0, g = _problem(7)
    var, slot = tf.Variable(w0), tf.Variable(np.zeros([500], "float32"))

    @tf.function(jit_compile=True)
    def step():
        return _step("momentum", [var.handle], [[slot.handle]], [tf.constant(g.ravel()[:500])], 1.0, offsets=[0])

    with pytest.raises((tf.errors.UnimplementedError, tf.errors.InvalidArgumentError),
                       match="var_offsets .* is not compiled by XLA"):
        step()
