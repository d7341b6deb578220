import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest

# Tolerances by dtype name: (rtol, atol).
TOL = {
    "float64": (1e-12, 1e-12),
    "float32": (2e-6, 1e-6),
    "float16": (2e-3, 1e-3),
    "bfloat16": (2e-2, 1e-2),
}


def assert_close(actual, expected, dtype_name, scale=1.0):
    rtol, atol = TOL[dtype_name]
    np.testing.assert_allclose(
        np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64),
        rtol=rtol * scale, atol=atol * scale)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
