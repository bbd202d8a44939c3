"""Files saved by earlier code load, and train on, as they did then.

`tests/saving/data/<commit>/` holds a `.keras` file and a checkpoint written by
the code of that commit (`make_saved.py` says how), and what that code read
back. ab2b52d is the last commit before the step and the boundaries were
restructured (the "house" redesign): a format or behaviour change since then
fails here.
"""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls  # noqa: F401  (registers tfdls' layers and optimizer for load_model)
from tests.saving.data import make_saved
from tests.saving.test_packed_state import checkpoint_contents

FOLDER = os.path.join(os.path.dirname(__file__), "data", "ab2b52d")

# ab2b52d compiled this small model's apply (jit_compile="auto"); since, on a CPU an apply
# this small runs uncompiled (tfdls._plan.AUTO_COMPILE_MIN_ELEMENTS), which rounds a few
# finite updates differently (XLA's rounding against graph mode's). Planned as then, the
# training must go on bit for bit.
pytestmark = pytest.mark.usefixtures("plan_as_on_an_accelerator")


def _has_avx512():
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:  # not Linux: the file's own machine is assumed
        return True


@pytest.fixture(scope="module")
def expected():
    """What ab2b52d's code read back. XLA compiles the apply for the host's vector
    instructions, which round a few updates differently: `expected.json` was written on
    a CPU with AVX-512; on one without, the weights after the epoch are those ab2b52d's
    own code gives there (`expected_weights_without_avx512.json`, made by that code from
    the same files), so the comparison stays bit for bit, code against code."""
    with open(os.path.join(FOLDER, "expected.json")) as f:
        expected = json.load(f)
    if not _has_avx512():
        with open(os.path.join(FOLDER, "expected_weights_without_avx512.json")) as f:
            expected["weights_after_one_epoch"] = json.load(f)["weights_after_one_epoch"]
    return expected


def _trains_on_as_before(model, expected):
    make_saved.fit(model, epochs=1)
    assert make_saved.state(model) == expected["after_one_epoch"]
    for i, (now, then) in enumerate(zip(make_saved.weights(model),
                                        expected["weights_after_one_epoch"], strict=True)):
        np.testing.assert_array_equal(np.asarray(now), np.asarray(then), err_msg=f"weight {i}")


@pytest.mark.slow
def test_a_keras_file_saved_before_loads_and_trains_on_alike(expected):
    model = keras.models.load_model(os.path.join(FOLDER, "model.keras"))
    assert isinstance(model.optimizer, tfdls.LossScaleOptimizer)
    model.optimizer.set_scale_boundaries(model)  # a model is not part of a config
    assert make_saved.state(model) == expected["saved"]
    _trains_on_as_before(model, expected)


@pytest.mark.slow
def test_a_checkpoint_written_before_restores_and_trains_on_alike(expected):
    model = make_saved.model_and_optimizer()
    model.optimizer.build(model.trainable_variables)
    status = tf.train.Checkpoint(optimizer=model.optimizer, model=model).read(
        os.path.join(FOLDER, "ckpt"))
    status.assert_consumed()  # every value in the file found its object, and back
    assert make_saved.state(model) == expected["saved"]
    _trains_on_as_before(model, expected)


def test_a_checkpoint_written_before_is_written_back_alike(tmp_path):
    """Restored and written again at once, the checkpoint holds every key of the earlier
    one, with its dtype and value, and no other: the overflow record's fields, one
    variable since (`tfdls._packed_state`), among them."""
    model = make_saved.model_and_optimizer()
    model.optimizer.build(model.trainable_variables)
    checkpoint = tf.train.Checkpoint(optimizer=model.optimizer, model=model)
    checkpoint.read(os.path.join(FOLDER, "ckpt")).assert_consumed()
    again = checkpoint.write(str(tmp_path / "ckpt"))
    assert checkpoint_contents(again) == checkpoint_contents(os.path.join(FOLDER, "ckpt"))
