"""The one place tfclip hooks another library: a tfclip optimizer handed to the other Keras.

`tfclip.keras` (Keras 3) and `tfclip.tf_keras` (Keras 2, the tf-keras package) optimizers look
alike, and a program that builds a tf_keras model and compiles it with `tfclip.keras.Adam` (or the
other way round) would get the stock error `Could not interpret optimizer identifier`. So
`install` wraps each library's `optimizers.get` (what `Model.compile` calls for its optimizer) to
raise a ValueError naming both libraries and the class to use; everything else goes to the stock
`get`. It runs where both libraries may meet: when `tfclip.tf_keras` is imported, and when a
`tfclip.keras` optimizer is made while tf_keras is loaded. It imports neither front door: the
classes say which library they serve by their `_tfclip_library` attribute ("keras" or
"tf_keras"), and tf_keras is wrapped only where the program has imported it already (importing
it costs seconds).
"""
import sys

def _public_class(obj, library):
    """The class users know (`Adam`, `legacy.Adam`): the first class of tfclip's module."""
    module = f"tfclip.{library}"
    return next((c for c in type(obj).__mro__ if c.__module__ == module), type(obj))


def refusal(obj, into):
    """The ValueError for a tfclip optimizer `obj` handed to the library `into` ("keras" or
    "tf_keras") that is not its own, or None."""
    library = getattr(type(obj), "_tfclip_library", None)
    if library is None or library == into:
        return None
    cls = _public_class(obj, library)
    own, name = cls.__qualname__, cls.__name__  # (legacy.Adam: the other library's is Adam)
    if library == "keras":
        return ValueError(
            f"tfclip.keras.{own} is an optimizer for Keras 3 (the keras package), but it was given to "
            f"tf_keras (Keras 2, the tf-keras package; TF_USE_LEGACY_KERAS=1 makes tf.keras that): use "
            f"tfclip.tf_keras.{name} with tf_keras models, and tfclip.keras.{own} with Keras 3 models.")
    return ValueError(
        f"tfclip.tf_keras.{own} is an optimizer for tf_keras (Keras 2, the tf-keras package), but "
        f"it was given to Keras 3 (the keras package): use tfclip.keras.{name} with Keras 3 models, "
        f"and tfclip.tf_keras.{own} with tf_keras models (or set TF_USE_LEGACY_KERAS=1 and build "
        "the model with tf_keras).")


def check(obj, into):
    """Raises `refusal(obj, into)` where there is one."""
    error = refusal(obj, into)
    if error is not None:
        raise error


def _wrap_get(module, into):
    stock_get = module.get
    if getattr(stock_get, "_tfclip_into", None) == into:
        return

    def get(identifier, *args, **kwargs):
        check(identifier, into)
        return stock_get(identifier, *args, **kwargs)

    get._tfclip_into = into
    get.__wrapped__ = stock_get
    get.__doc__ = stock_get.__doc__
    module.get = get


def install():
    """Wraps tf_keras's and Keras 3's `optimizers.get` (once each), where tf_keras is loaded."""
    if "tf_keras" not in sys.modules:
        return
    from tf_keras.src import optimizers as tf_keras_optimizers

    _wrap_get(tf_keras_optimizers, "tf_keras")
    try:
        import keras

        if int(str(keras.__version__).split(".")[0]) < 3:
            return
        from keras.src import optimizers as keras_optimizers
    except Exception:  # no Keras 3 here: nothing to guard
        return
    _wrap_get(keras_optimizers, "keras")
