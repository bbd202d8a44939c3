"""tfdls._requirements.check: a clear ImportError for too-old TF / Keras."""

import re

import keras
import pytest
import tensorflow as tf

from tfdls import _requirements


def test_old_tensorflow_names_minimum_and_found_version():
    with pytest.raises(ImportError) as info:
        _requirements.check(tensorflow_version="2.15.1")
    message = str(info.value)
    assert "2.16" in message
    assert "2.15.1" in message
    assert "TensorFlow" in message


def test_old_keras_names_keras_and_found_version():
    with pytest.raises(ImportError) as info:
        _requirements.check(keras_version="2.15.0")
    message = str(info.value)
    assert "Keras" in message
    assert "2.15.0" in message
    assert re.search(r"Keras >= 3", message), message


@pytest.mark.parametrize("version", ["2.9.0", "1.15.5", "2.2.0", "0.12.1", "2.15.0rc1"])
def test_old_tensorflow_versions_compared_numerically(version):
    # "2.9" > "2.16" as strings: the comparison must be numeric.
    with pytest.raises(ImportError, match=re.escape(version)):
        _requirements.check(tensorflow_version=version)


@pytest.mark.parametrize("version", ["2.16.0", "2.16.0rc0", "2.21.0", "2.100.1", "3.0.0"])
def test_new_enough_tensorflow_versions_pass(version):
    assert _requirements.check(tensorflow_version=version) is None


@pytest.mark.parametrize("version", ["3.0.0", "3.15.1", "3.1.0.dev2024", "4.0.0"])
def test_new_enough_keras_versions_pass(version):
    assert _requirements.check(keras_version=version) is None


def test_current_versions_pass():
    assert _requirements.check() is None
    assert _requirements.check(tensorflow_version=tf.__version__, keras_version=keras.__version__) is None


def test_message_has_install_hint():
    with pytest.raises(ImportError, match=r"pip install"):
        _requirements.check(tensorflow_version="2.15.1")
