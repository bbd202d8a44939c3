"""pytest setup of the GPU tests (test_gpu.py): the first GPU as two logical GPUs, for
MirroredStrategy. Logical devices can only be configured before TensorFlow initializes
them, so it is done here, when pytest loads this file, before any test runs."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

GPU_MEMORY_MB = 8192  # each logical GPU's; the largest case needs a fraction of it

_gpus = tf.config.list_physical_devices("GPU")
if _gpus:
    tf.config.set_logical_device_configuration(
        _gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=GPU_MEMORY_MB)] * 2)
