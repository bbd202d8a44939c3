"""tfdls._compat: the versions tfdls needs and the private names it uses."""

import re

import keras
import numpy as np
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


def test_computed_once_is_a_barrier_inside_xla_and_nothing_outside():
    values = (tf.constant([1.5, -2.0]), tf.constant(3, tf.int32))
    assert _compat.computed_once(*values) == values  # eager: the same objects

    def ops_of(jit_compile):
        def fn(x, k):
            a, b = _compat.computed_once(x * 2.0, k + 1)
            return a + 1.0, b

        concrete = tf.function(fn, jit_compile=jit_compile).get_concrete_function(*values)
        out = concrete(*values)
        np.testing.assert_array_equal(out[0].numpy(), [4.0, -3.0])
        assert int(out[1]) == 4
        return [op.type for op in concrete.graph.get_operations()]

    assert "XlaOptimizationBarrier" in ops_of(True)
    assert "XlaOptimizationBarrier" not in ops_of(False)


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


def _import_in_subprocess(code, **env):
    import os
    import subprocess
    import sys

    environment = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    environment.update(env, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=environment
    )


@pytest.mark.parametrize(
    "backend, code",
    [
        ("jax", "import tfdls"),  # jax is not installed: Keras itself could not import
        pytest.param("torch", "import tfdls", marks=pytest.mark.slow),  # nor torch
        # Keras' numpy backend needs jax too.
        pytest.param("numpy", "import tfdls", marks=pytest.mark.slow),
    ],
)
def test_another_keras_backend_is_an_import_error_naming_it(backend, code):
    result = _import_in_subprocess(code, KERAS_BACKEND=backend)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: tfdls needs Keras' TensorFlow backend"), last
    assert repr(backend) in last and "KERAS_BACKEND=tensorflow" in last, last


@pytest.mark.slow
def test_a_backend_from_keras_json_is_named_with_its_file(tmp_path):
    (tmp_path / "keras.json").write_text('{"backend": "numpy"}')
    result = _import_in_subprocess("import tfdls", KERAS_HOME=str(tmp_path))
    last = result.stderr.strip().splitlines()[-1]
    assert "'numpy' backend" in last and str(tmp_path / "keras.json") in last, last


@pytest.mark.slow
def test_the_tensorflow_backend_imports():
    result = _import_in_subprocess("import tfdls; print('ok')", KERAS_BACKEND="tensorflow")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_keras_imported_on_another_backend_is_named(monkeypatch):
    """With the backend's package installed, Keras imports; tfdls asks Keras itself."""
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(ImportError, match=r"'jax' backend \(keras\.backend\.backend\(\)\)"):
        _compat.check_versions()


def test_check_backend_accepts_only_tensorflow():
    assert _compat.check_backend("tensorflow") is None
    with pytest.raises(ImportError, match=r"'jax' backend \(from a test\)"):
        _compat.check_backend("jax", "from a test")
