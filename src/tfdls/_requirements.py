"""A clear ImportError when TensorFlow or Keras is missing or too old."""

MIN_TENSORFLOW = (2, 16)
MIN_KERAS = (3, 0)

_INSTALL_HINT = (
    'Install one TensorFlow build: pip install "tfdls[cpu]" (tensorflow-cpu) or '
    'pip install "tfdls[gpu]" (tensorflow[and-cuda]).'
)


def _version_tuple(version):
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _need(found):
    return ImportError(
        "tfdls needs TensorFlow >= {}.{} and Keras >= {}.{}; found {}. ".format(
            *MIN_TENSORFLOW, *MIN_KERAS, found
        )
        + _INSTALL_HINT
    )


def check(tensorflow_version=None, keras_version=None):
    """Raises ImportError unless TensorFlow >= 2.16 and Keras >= 3 are importable.

    The version arguments exist for tests; by default the installed modules
    are inspected.
    """
    if tensorflow_version is None:
        try:
            import tensorflow
        except ImportError as error:
            raise _need(f"none ({error})") from error
        tensorflow_version = tensorflow.__version__
    if _version_tuple(tensorflow_version) < MIN_TENSORFLOW:
        raise _need(f"TensorFlow {tensorflow_version}")
    if keras_version is None:
        try:
            import keras
        except ImportError as error:
            raise _need(f"none ({error})") from error
        keras_version = getattr(keras, "__version__", "0")
    if _version_tuple(keras_version) < MIN_KERAS:
        raise _need(f"Keras {keras_version}")
