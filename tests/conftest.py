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


@pytest.fixture
def plan_as_on_an_accelerator(monkeypatch):
    """`jit_compile="auto"` plans as where a GPU or TPU is visible: a masked apply is
    compiled whatever its size. Without one, an apply smaller than
    `tfdls._plan.AUTO_COMPILE_MIN_ELEMENTS` runs uncompiled with a cond; the tests of
    the compiled masked step use small models, so they ask for this."""
    from tfdls import _plan

    monkeypatch.setattr(_plan, "accelerator_visible", lambda: True)


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


# XLA's CPU compiler maps every function it compiles into memory (about 30
# maps for a small step) and never unmaps it while the process lives; past
# the kernel's vm.max_map_count (65,530 by default) TensorFlow segfaults. The
# whole suite compiles more than that, so pyproject.toml's addopts run it in
# two pytest-xdist processes, and this guard stops a process that nears the
# limit with a message instead of a crash. The largest single test adds
# fewer than 2,000 maps (test_factor_readings' drawn XLA call sequences).
MAPS_HEADROOM = 6000


def memory_maps():
    """(maps this process holds, the most it may hold), or None off Linux.

    TFDLS_TESTS_MAX_MAPS overrides the kernel's limit (to test this guard).
    """
    try:
        with open("/proc/self/maps") as maps:
            held = sum(1 for _ in maps)
        with open("/proc/sys/vm/max_map_count") as limit:
            most = int(os.environ.get("TFDLS_TESTS_MAX_MAPS") or limit.read())
    except OSError:
        return None
    return held, most


def memory_maps_message(where):
    """A message if this process holds too many memory maps to go on, else None."""
    maps = memory_maps()
    if maps is None or maps[0] <= maps[1] - MAPS_HEADROOM:
        return None
    return (
        f"stopped before {where}: this test process holds {maps[0]} memory maps of the "
        f"{maps[1]} the kernel allows (vm.max_map_count), and TensorFlow crashes past that. "
        "XLA's CPU compiler keeps every function it compiled mapped until the process "
        "ends: run the tests in more processes (pytest -n 3, ...) or fewer tests per run."
    )


def check_memory_maps(where):
    """Raises where this process nears the memory-map limit (within one test:
    a hypothesis example fails with this message instead of crashing;
    hypothesis then shrinks it to some small example, which is not the cause)."""
    message = memory_maps_message(where)
    if message is not None:
        raise RuntimeError(message)


def pytest_runtest_setup(item):
    message = memory_maps_message(item.nodeid)
    if message is not None:
        # Not pytest.exit: in an xdist worker that ends as an INTERNALERROR
        # without the message. This fails the test's setup with it and stops
        # the session (every worker's): "Interrupted: stopped before ...".
        item.session.shouldstop = message
        pytest.fail(message, pytrace=False)
