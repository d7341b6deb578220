"""The rule bindings the Keras 3 and tf_keras drop-ins share (`tfclip._engine.binding.Binding`):
their stock classes keep these slots and hyper-parameters under the same attribute names. A
class whose attributes differ between the two libraries (SGD, Adam, Lion) or that exists in one
only keeps its row in its front door (tfclip/keras/__init__.py, tfclip/tf_keras/__init__.py)."""
from tfclip._engine import opcall as _opcall
from tfclip._engine.binding import STEP, Binding


def positive_momentum(opt):  # (stock RMSprop: a momentum slot only for momentum > 0)
    return opt.momentum > 0


def general_ftrl(opt):  # (Ftrl's general rule takes the power as an input; the sqrt one, none)
    return bool(_opcall.ftrl_variant(opt.learning_rate_power)[1])


M_V = (("m", "_momentums"), ("v", "_velocities"))
BETAS_STEP = (("beta_1", "beta_1"), ("beta_2", "beta_2"), ("epsilon", "epsilon"), ("step", STEP))

RMSPROP = Binding("rmsprop", slots=(("velocity", "_velocities"),
                                    ("momentum_slot", "_momentums", positive_momentum),
                                    ("average_gradient", "_average_gradients", "centered")),
                  hparams=(("rho", "rho"), ("momentum", "momentum"), ("epsilon", "epsilon")),
                  flags=(("centered", "centered"), ("has_momentum", positive_momentum)))
ADAGRAD = Binding("adagrad", slots=(("accumulator", "_accumulators"),), hparams=(("epsilon", "epsilon"),))
ADADELTA = Binding("adadelta", slots=(("accumulated_grad", "_accumulated_grads"),
                                      ("accumulated_delta_var", "_accumulated_delta_vars")),
                   hparams=(("rho", "rho"), ("epsilon", "epsilon")))
ADAMAX = Binding("adamax", slots=(("m", "_m"), ("u", "_u")), hparams=BETAS_STEP)
# Nadam's momentum-cache product through this step: the front door's `_u_next`, computed per step.
NADAM = Binding("nadam", slots=M_V, hparams=BETAS_STEP + (("u_product", lambda o, _: o._u_next),))
FTRL = Binding(("ftrl", "ftrl_sqrt"), pick=lambda o: _opcall.ftrl_variant(o.learning_rate_power)[0],
               slots=(("accumulator", "_accumulators"), ("linear", "_linears")),
               hparams=(("lr_power", "learning_rate_power", general_ftrl),
                        ("l1", "l1_regularization_strength"), ("l2", "l2_regularization_strength"),
                        ("l2_shrinkage", "l2_shrinkage_regularization_strength"), ("beta", "beta")))
ADAFACTOR = Binding("adafactor", slots=(("r", "_r"), ("c", "_c"), ("v", "_v")),
                    hparams=(("beta_2_decay", "beta_2_decay"), ("epsilon_1", "epsilon_1"),
                             ("epsilon_2", "epsilon_2"), ("clip_threshold", "clip_threshold"), ("step", STEP)))
