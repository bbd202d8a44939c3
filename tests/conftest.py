"""Shared test setup.

TensorFlow's logical devices can only be configured before it initializes,
so the CPU is split into two logical devices here, once for the whole
session: MirroredStrategy tests use both, every other test runs on the first.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2
)

REPLICA_DEVICES = ["/cpu:0", "/cpu:1"]


@pytest.fixture(scope="session")
def mirrored_strategy():
    """A MirroredStrategy over the two logical CPU devices, shared by every test.

    One per process: two MirroredStrategy instances in one process can clash
    on TensorFlow's collective keys ("Shape mismatch in the collective
    instance 100", reproduced with plain Keras Adam), so every test uses this
    one, and multi-process tests start their own processes.
    """
    return tf.distribute.MirroredStrategy(REPLICA_DEVICES)


@pytest.fixture(autouse=True)
def _float32_policy():
    """Every test starts and ends with the default float32 policy."""
    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture(
    params=[
        # The fast loop (-m "not slow") runs each such test in graph mode;
        # CI runs all three.
        pytest.param("eager", marks=pytest.mark.slow),
        "function",
        pytest.param("xla", marks=pytest.mark.slow),
    ]
)
def run_mode(request):
    """Wraps a Python step function for eager, tf.function or XLA execution."""

    def wrap(fn):
        if request.param == "eager":
            return fn
        return tf.function(fn, jit_compile=request.param == "xla")

    wrap.mode = request.param
    return wrap
