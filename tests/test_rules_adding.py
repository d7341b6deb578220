"""docs/architecture.md's "Adding an update rule" and "Adding a clip mode", checked: every
rule-table row is bound (as data, `tfclip._engine.binding.Binding`) by `tfclip.rules` and by each
front door whose stock library has the class; every binding names the hyper-parameters its row
needs and no other; nothing but a binding names a rule; the fused step is said once
(`tfclip/_engine/step.py`), so an adaptive clip mode runs the same in every front door."""
import ast
import inspect
import os

import numpy as np
import pytest
import tensorflow as tf

import tfclip
import tfclip.compat.v1 as v1
from tfclip import _core, clipping
from tfclip._engine.binding import Binding

TABLE = _core.rule_table()
HPARAMS = _core.hparam_table()
HERE = os.path.dirname(os.path.abspath(tfclip.__file__))
# Every Python module but the op-call builder (tfclip/_engine/opcall.py, which picks Ftrl's variant).
PY_MODULES = sorted(os.path.relpath(os.path.join(d, f), HERE) for d, _, fs in os.walk(HERE) for f in fs
                    if f.endswith(".py") and os.path.relpath(os.path.join(d, f), HERE) != os.path.join("_engine", "opcall.py"))
# What the front door gives every rule itself (not in a binding row): the schedule's learning
# rate, Keras's weight decay per group.
FROM_THE_FRONT_DOOR = {"lr", "weight_decay"}


def _bindings(classes):
    """Each class's bindings by name: its `binding` or `_tfclip_binding`, and any other Binding it
    holds (tfclip.keras.Muon's step runs three rows)."""
    out = {}
    for c in classes:
        out[c.__qualname__] = getattr(c, "binding", None) or c._tfclip_binding
        for attr, b in inspect.getmembers(c, lambda x: isinstance(x, Binding)):
            if attr not in ("binding", "_tfclip_binding"):
                out[f"{c.__qualname__}.{attr}"] = b
    return out


def _front_doors():
    doors = {"tfclip.rules": _bindings([c for c in vars(tfclip.rules).values() if inspect.isclass(c)
                                        and issubclass(c, tfclip.rules.Rule) and c.binding is not None]),
             "tfclip.compat.v1": _bindings(list(v1._CLASSES))}
    try:
        import tfclip.keras as k3
        doors["tfclip.keras"] = _bindings(k3._CLASSES)
    except ImportError:  # TF 2.15: no Keras 3 (tfclip.keras says why)
        pass
    try:
        import tfclip.tf_keras as tk
        doors["tfclip.tf_keras"] = _bindings(tk._CLASSES + tk._LEGACY_CLASSES)
    except ImportError:  # the tf-keras package is not installed
        pass
    return doors


# Rows tfclip.rules has no class for, and why.
NOT_A_RULE_CLASS = {"tf_rmsprop": "TF1's RMSProp kernel order: tfclip.compat.v1.RMSPropOptimizer and "
                                  "tfclip.tf_keras.legacy.RMSprop (momentum) bind it",
                    "muon_momentum": "Muon's matrix step before its Newton-Schulz products (not element-wise, "
                                     "so not a fused_clip_apply rule): tfclip.keras.Muon binds it",
                    "muon_update": "Muon's matrix step after its Newton-Schulz products: tfclip.keras.Muon binds it"}


def test_every_rule_table_row_is_bound():
    doors = _front_doors()
    rules = {k for b in doors["tfclip.rules"].values() for k in b.all_kinds()}
    assert rules == set(TABLE) - set(NOT_A_RULE_CLASS), \
        f"rows without a tfclip.rules class or a stated reason: {sorted(set(TABLE) - rules - set(NOT_A_RULE_CLASS))}"
    anywhere = {k for bindings in doors.values() for b in bindings.values() for k in b.all_kinds()}
    # (Muon's rows are Keras 3's alone: TF 2.15 has no tfclip.keras)
    keras3_only = set() if "tfclip.keras" in doors else {"muon_momentum", "muon_update"}
    assert anywhere >= set(TABLE) - {"tf_rmsprop"} - keras3_only and "tf_rmsprop" in {
        k for b in doors["tfclip.compat.v1"].values() for k in b.all_kinds()}


@pytest.mark.parametrize("door", ["tfclip.rules", "tfclip.compat.v1", "tfclip.keras", "tfclip.tf_keras"])
def test_every_binding_names_its_rows_hyper_parameters_slots_and_flags(door):
    doors = _front_doors()
    if door not in doors:
        pytest.skip(f"{door} cannot be imported here (its stock library is absent)")
    for name, b in doors[door].items():
        assert b.all_kinds(), name
        if b.pick is None:
            assert isinstance(b.kinds, str), f"{door}.{name}: several kinds need `pick`"
        for kind in b.all_kinds():
            row = TABLE[kind]
            hps = {r[0] for r in b.hparams}
            required = {h for h in row["hparams"] if not HPARAMS[h]["optional"]}
            # A conditional row (`when`) may be left out by one of the kinds: the op call checks
            # that per step; here every name must be the table's, and every required one given
            # (by the binding or the front door) by some row.
            assert hps <= set(row["hparams"]) | {h for k in b.all_kinds() for h in TABLE[k]["hparams"]}, \
                f"{door}.{name}: {sorted(hps - set(row['hparams']))} are not {kind}'s"
            assert required <= hps | FROM_THE_FRONT_DOOR, \
                f"{door}.{name}: {kind} needs {sorted(required - hps - FROM_THE_FRONT_DOOR)}"
            assert not hps & FROM_THE_FRONT_DOOR - {"lr"}, f"{door}.{name}: weight_decay is the front door's"
            slots = {r[0] for r in b.slots}
            assert slots <= {s for k in b.all_kinds() for s in TABLE[k]["slots"]}, f"{door}.{name}: {slots}"
            assert {r[0] for r in b.flags} <= {f for k in b.all_kinds() for f in TABLE[k]["flags"]}, \
                f"{door}.{name}: {[r[0] for r in b.flags]}"


# The stock classes tfclip has no drop-in for, and why (issue 46 brings Adafactor and Muon).
NOT_BOUND = {
    "keras": {"Optimizer": "the base class", "LossScaleOptimizer": "a wrapper: it wraps tfclip's",
              "MultiOptimizer": "a wrapper of several optimizers (tfclip's among them)",
              "Adafactor": "factored second moments (not element-wise; issue 46)",
              "Muon": "matrix orthogonalisation (not element-wise; issue 46)"},
    "tf_keras": {"Optimizer": "the base class", "Adafactor": "factored second moments (issue 46)",
                 "LossScaleOptimizer": "a wrapper: it wraps tfclip's"},
    "tf_keras.legacy": {"Optimizer": "the base class"},
    "tf.compat.v1.train": {"Optimizer": "the base class",
                           "SyncReplicasOptimizer": "a wrapper: it wraps tfclip's"},
}


def _stock_classes(module, base):
    return {n for n, c in vars(module).items() if inspect.isclass(c) and issubclass(c, base)}


def _check_coverage(library, stock, ours):
    missing = stock - ours - set(NOT_BOUND[library])
    assert not missing, f"stock {library} classes without a tfclip binding or a stated reason: {sorted(missing)}"


def test_every_stock_keras3_optimizer_has_a_binding_or_a_reason():
    try:
        import keras

        import tfclip.keras as k3
    except ImportError as e:  # TF 2.15: no Keras 3 (tfclip.keras says why)
        pytest.skip(f"tfclip.keras cannot be imported here: {e}")

    _check_coverage("keras", _stock_classes(keras.optimizers, keras.optimizers.Optimizer),
                    {c.__name__ for c in k3._CLASSES})


def test_every_stock_tf_keras_optimizer_has_a_binding_or_a_reason():
    try:
        import tf_keras

        import tfclip.tf_keras as tk
    except ImportError as e:  # (tfclip.tf_keras says why: the tf-keras package is absent)
        pytest.skip(f"tfclip.tf_keras cannot be imported here: {e}")

    _check_coverage("tf_keras", _stock_classes(tf_keras.optimizers, tf_keras.optimizers.Optimizer),
                    {c.__name__ for c in tk._CLASSES})
    _check_coverage("tf_keras.legacy",
                    _stock_classes(tf_keras.optimizers.legacy, tf_keras.optimizers.legacy.Optimizer),
                    {c.__name__ for c in tk._LEGACY_CLASSES})


def test_every_stock_tf1_optimizer_with_a_training_op_has_a_binding_or_a_reason():
    _check_coverage("tf.compat.v1.train",
                    _stock_classes(tf.compat.v1.train, tf.compat.v1.train.Optimizer),
                    {c.__name__ for c in v1._CLASSES})


def _string_constants_outside_bindings(path, names):
    tree = ast.parse(open(path).read())
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Binding":
            inside.update(id(n) for n in ast.walk(node))
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in names and id(node) not in inside)


@pytest.mark.parametrize("module", PY_MODULES)
def test_nothing_but_a_binding_names_a_rule(module):
    # Adding a rule is its struct, its table row and one binding row per front door: a rule
    # named anywhere else in the Python layer would be one more place to change.
    # (A rule named as its hyper-parameter, slot or flag is, e.g. `momentum`, is not told apart.)
    other = set(HPARAMS) | {n for row in TABLE.values() for n in row["slots"] + row["flags"]}
    found = _string_constants_outside_bindings(os.path.join(HERE, module), set(TABLE) - other)
    assert not found, f"tfclip/{module} names rules outside a Binding row (line, name): {found}"


@pytest.mark.parametrize("module", [m for m in PY_MODULES if m not in ("clipping.py", "demo.py")])
def test_no_front_door_names_a_clip_mode(module):
    # An adaptive clip mode is its class in tfclip/clipping.py and its `_MODES` entry; the fused
    # step (tfclip/_engine/step.py) takes any of them.
    found = _string_constants_outside_bindings(os.path.join(HERE, module), set(clipping._MODES))
    assert not found, f"tfclip/{module} names clip modes (line, name): {found}"


def test_every_clip_class_is_a_named_mode():
    classes = {c for c in vars(clipping).values() if inspect.isclass(c)
               and (issubclass(c, clipping.AdaptiveClip) or c is clipping.AGC) and c.mode is not None}
    assert classes == set(clipping._MODES.values())
    for mode, cls in clipping._MODES.items():
        assert cls.mode == mode
        assert type(clipping.get(clipping.serialize(cls()))) is cls


@pytest.mark.parametrize("mode", sorted(clipping._MODES))
def test_a_clip_mode_runs_the_same_through_every_front_door(mode):
    # The one fused step: fused_clip_apply (tfclip.rules), the Keras 3 drop-in and tf.compat.v1
    # give the same bits for the same clip mode, hyper-parameters and gradients, and a step
    # that clips changes the update against an unclipped one (so the clip did run).
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((6, 4)).astype(np.float32)
    # (ZClip and AutoClip clip once they have seen some norms: a spike after 30 steps.)
    grads = [rng.standard_normal((6, 4)).astype(np.float32) * s for s in [1.0] * 30 + [40.0] * 2]

    def run(step_fn):
        v = tf.Variable(w0)
        apply = step_fn(v)
        for g in grads:
            apply(tf.constant(g))
        return v.numpy()

    def with_rule(v, clip):
        rule = tfclip.rules.SGD(0.1)
        return lambda g: tfclip.fused_clip_apply([(g, v)], rule, clip=clip)

    def with_v1(v):
        opt = v1.GradientDescentOptimizer(0.1, clip=mode)
        return lambda g: opt.apply_gradients([(g, v)])

    ours = run(lambda v: with_rule(v, mode))
    np.testing.assert_array_equal(run(with_v1), ours)
    try:
        import tfclip.keras as k3
    except ImportError:
        k3 = None
    if k3 is not None:
        def with_keras(v):
            opt = k3.SGD(0.1, clip=mode)
            return lambda g: opt.apply([g], [v])

        np.testing.assert_array_equal(run(with_keras), ours)
    unclipped = run(lambda v: with_rule(v, None))
    assert not np.array_equal(ours, unclipped), f"{mode} never clipped: the check proves nothing"
