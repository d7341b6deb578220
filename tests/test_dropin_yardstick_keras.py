"""Keras's own optimizer tests, run unchanged against the tfclip classes: the yardstick of the
drop-in promise. The test files ship inside the keras wheel (keras/src/optimizers/*_test.py);
each is imported, the stock class it tests is replaced by tfclip's in its namespace, and every
one of its test methods runs as one pytest case here. Nothing of theirs is copied."""
import importlib
import types
import unittest

import pytest

import keras
import tfclip

CLASSES = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam", "Lion", "Ftrl", "Lamb",
           "Adafactor", "Muon"]
# ScheduleFreeAdamW where this Keras has it (its test file is then in the wheel too).
CLASSES += ["ScheduleFreeAdamW"] if hasattr(keras.optimizers, "ScheduleFreeAdamW") else []
TFCLIP = {**{c: getattr(tfclip.keras, c) for c in CLASSES}, "get": tfclip.keras.get}
# The test file of each class, where its name is not the lowercased class name.
TEST_FILE = {"ScheduleFreeAdamW": "schedule_free_adamw_test"}
# module: the names in its namespace that are the stock classes (optimizer_test imports the
# whole `optimizers` package and reaches SGD/Adam/AdamW through it).
MODULES = {**{TEST_FILE.get(c, f"{c.lower()}_test"): [c] for c in CLASSES}, "optimizer_test": ["optimizers"]}


# Cases that may build no tfclip class: the parameterized tests' cases 3-10 (Adagrad, RMSprop, ...,
# Lamb, and Adafactor, which tfclip has not).
NO_OPTIMIZER = {f"{t}{i}" for t in ("test_gradient_accumulation_with_weigth_decay", "test_pickleable_optimizers")
                for i in range(3, 11)}


class _OptimizersWithTfclip(types.ModuleType):
    """keras.src.optimizers, with the classes tfclip has replaced by tfclip's."""

    def __init__(self, real):
        super().__init__(real.__name__)
        self._real = real

    def __getattr__(self, name):
        return TFCLIP.get(name) or getattr(self._real, name)


def _load(name):
    try:
        return importlib.import_module(f"keras.src.optimizers.{name}")
    except ModuleNotFoundError:
        return None


def _cases():
    out = []
    for mod_name in MODULES:
        mod = _load(mod_name)
        if mod is None:
            out.append(pytest.param(mod_name, None, None, marks=pytest.mark.skip(
                reason=f"this keras ({keras.__version__}) wheel ships no keras/src/optimizers/{mod_name}.py")))
            continue
        for cls in vars(mod).values():
            if isinstance(cls, type) and issubclass(cls, unittest.TestCase) and cls.__module__ == mod.__name__:
                for test in unittest.TestLoader().getTestCaseNames(cls):
                    out.append(pytest.param(mod_name, cls.__name__, test, id=f"{mod_name}.{test}"))
    return out


@pytest.mark.parametrize("mod_name,cls_name,test", _cases())
def test_keras_own_optimizer_test_passes_with_tfclip(monkeypatch, mod_name, cls_name, test):
    mod = _load(mod_name)
    for name in MODULES[mod_name]:
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, _OptimizersWithTfclip(real) if name == "optimizers" else TFCLIP[name])
    made = []  # the tfclip optimizers the test built: proof that the swap took effect
    for cls in (TFCLIP[c] for c in CLASSES):
        def counted(self, *a, _init=cls.__init__, **kw):
            made.append(type(self).__name__)
            _init(self, *a, **kw)
        monkeypatch.setattr(cls, "__init__", counted)
    result = unittest.TestResult()
    getattr(mod, cls_name)(test).run(result)
    problems = result.failures + result.errors
    assert not problems, problems[0][1]
    assert made or test in NO_OPTIMIZER, f"{test} built no tfclip optimizer"
    assert not result.skipped or all("backend" in why or "JAX" in why for _, why in result.skipped), result.skipped
