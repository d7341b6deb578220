"""A stock optimizer class's binding to rule-table rows, as data (`Binding`): what a front door's
step reads to build its apply ops (`tfclip._engine.step.optimizer_groups`). The bindings Keras 3
and tf_keras share (their classes keep the same attributes): `tfclip._engine.keras_bindings`.
Imports nothing of tfclip's."""
import collections

STEP = "<iterations + 1>"  # a Binding's hyper-parameter source: the front door's `_tfclip_step()`


class Binding(collections.namedtuple("Binding", ["kinds", "slots", "hparams", "flags", "pick"],
                                     defaults=((), (), (), None))):
    """A stock optimizer class bound to rule-table rows, as data: what `inputs` reads.

    kinds: the rule-table rows it may run (a name, or a tuple of names with `pick`, a function of
        the optimizer giving the one a step runs: SGD's "sgd" or "keras_momentum").
    slots: (table slot, stock slot[, when]): the stock slot is what the front door's
        `_tfclip_slot(stock_slot, variables)` looks up (Keras 3: the attribute listing the slot
        variables; legacy: the slot name); `when`, an attribute name or a function of the
        optimizer, says whether the slot exists (Adam's vhat: "amsgrad").
    hparams: (table name, source[, when]): the source is an attribute name, read by the front
        door's `_tfclip_hparam(name, variables)`, `STEP` (iterations + 1), or a function
        (optimizer, variables) -> value. lr and weight_decay come from the front door.
    flags: (flag, source[, when]): an attribute name or a function of the optimizer.
    """

    def kind(self, opt):
        return self.pick(opt) if self.pick is not None else self.kinds

    def inputs(self, opt, tvars):
        """(kind, slot handle lists by table name, hyper-parameters, flags) for `tvars`."""
        slots = {name: opt._tfclip_slot(stock, tvars) for name, stock in self.slot_names(opt)}
        hparams, flags = self.values(opt, tvars)
        return self.kind(opt), slots, hparams, flags

    def slot_names(self, opt):
        """[(table slot, stock slot)] of the slots `opt` has, in the table's order."""
        return [(row[0], row[1]) for row in self.slots if _holds(opt, row)]

    def values(self, opt, tvars, step=None):
        """(hyper-parameters, flags) by the table's names. step: the value `STEP` takes where the
        front door gives it (an op owning the count takes the 1 it adds), else `_tfclip_step()`."""
        hparams = {}
        for row in self.hparams:
            if _holds(opt, row):
                src = row[1]
                hparams[row[0]] = ((opt._tfclip_step() if step is None else step) if src is STEP else src(opt, tvars) if callable(src)
                                   else opt._tfclip_hparam(src, tvars))
        flags = {row[0]: bool(row[1](opt) if callable(row[1]) else getattr(opt, row[1]))
                 for row in self.flags if _holds(opt, row)}
        return hparams, flags

    def all_kinds(self):
        return (self.kinds,) if isinstance(self.kinds, str) else tuple(self.kinds)


def _holds(opt, row):
    if len(row) < 3 or row[2] is None:
        return True
    when = row[2]
    return bool(when(opt) if callable(when) else getattr(opt, when))
