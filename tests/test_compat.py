"""tfdls._compat: the versions tfdls needs and the private names it uses."""

import re

import keras
import pytest
import tensorflow as tf

from tfdls import _compat


def test_old_tensorflow_names_minimum_and_found_version():
    with pytest.raises(ImportError) as info:
        _compat.check_versions(tensorflow_version="2.15.1")
    message = str(info.value)
    assert "2.16" in message
    assert "2.15.1" in message
    assert "TensorFlow" in message


@pytest.mark.parametrize("version", ["2.15.0", "3.0.0", "3.4.1", "3.8.0"])
def test_old_keras_names_keras_and_found_version(version):
    with pytest.raises(ImportError) as info:
        _compat.check_versions(keras_version=version)
    message = str(info.value)
    assert f"Keras {version}" in message
    assert re.search(r"Keras >= 3\.9", message), message


@pytest.mark.parametrize("version", ["2.9.0", "1.15.5", "2.2.0", "0.12.1", "2.15.0rc1"])
def test_old_tensorflow_versions_compared_numerically(version):
    # "2.9" > "2.16" as strings: the comparison must be numeric.
    with pytest.raises(ImportError, match=re.escape(version)):
        _compat.check_versions(tensorflow_version=version)


@pytest.mark.parametrize("version", ["2.16.0", "2.16.0rc0", "2.21.0", "2.100.1", "3.0.0"])
def test_new_enough_tensorflow_versions_pass(version):
    assert _compat.check_versions(tensorflow_version=version) is None


@pytest.mark.parametrize("version", ["3.9.0", "3.9.2", "3.10.0.dev2025", "3.15.1", "4.0.0"])
def test_new_enough_keras_versions_pass(version):
    assert _compat.check_versions(keras_version=version) is None


def test_current_versions_pass():
    assert _compat.check_versions() is None
    assert (
        _compat.check_versions(tensorflow_version=tf.__version__, keras_version=keras.__version__)
        is None
    )


def test_message_has_install_hint():
    with pytest.raises(ImportError, match=r"pip install") as info:
        _compat.check_versions(tensorflow_version="2.15.1")
    message = str(info.value)
    # tfdls is not on a package index: the hint installs from a checkout or a wheel.
    assert 'pip install ".[cpu]"' in message
    assert 'pip install ".[gpu]"' in message
    assert "wheel" in message
    assert "tfdls[" not in message
    # TensorFlow's extras do not pin a new enough Keras; tfdls' own requirement does.
    assert 'pip install "keras>=3.9"' in message


def test_a_missing_private_name_asks_for_the_versions_not_a_tracker():
    message = str(_compat._missing("keras.src.no_such_module"))
    assert "issue tracker" not in message
    assert "quote this message" in message
    assert "tf.__version__, keras.__version__" in message


def test_private_names_resolve_to_working_functions():
    assert _compat.in_xla_context() is False
    seen = []
    tf.function(lambda: seen.append(_compat.in_xla_context()), jit_compile=True).get_concrete_function()
    assert seen == [True]
    assert _compat.op_determinism_enabled() in (True, False)
    assert _compat.strategy_supports_no_merge_call() is True  # no strategy
    for name in _compat.OPTIMIZER_METHODS:
        assert callable(getattr(keras.optimizers.Optimizer, name))
    _compat.check_optimizer_instance(keras.optimizers.SGD())


def test_a_missing_private_name_is_a_clear_import_error():
    error = _compat._missing("keras.src.utils.tracking.no_automatic_dependency_tracking")
    assert isinstance(error, ImportError)
    assert "no_automatic_dependency_tracking" in str(error)
    assert "Keras >= 3.9" in str(error)


def test_require_names_a_missing_module_or_attribute():
    assert _compat._require("math", "sqrt").sqrt(4.0) == 2.0
    with pytest.raises(ImportError, match=r"relies on tfdls_no_such_module, .*No module named"):
        _compat._require("tfdls_no_such_module")
    with pytest.raises(ImportError, match=r"tfdls relies on math\.no_such_name, "):
        _compat._require("math", "no_such_name")
