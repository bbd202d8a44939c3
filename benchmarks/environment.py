"""The record of where and with what a benchmark ran: date, machine, versions, and which
tfdls sources were timed."""

import datetime
import hashlib
import importlib
import os
import pathlib
import platform

import tensorflow as tf


def cpu_name():
    """The CPU's model name (Linux' is not in `platform`)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def version(module_name):
    """`module.__version__`, or None if the module is not importable."""
    try:
        return getattr(importlib.import_module(module_name), "__version__", "unknown")
    except ImportError:
        return None


def source_digest():
    """sha256 (12 hex digits) of the imported tfdls' .py files: which code was timed."""
    digest = hashlib.sha256()
    root = pathlib.Path(importlib.import_module("tfdls").__file__).parent
    for path in sorted(root.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def environment():
    """Date, machine and versions (JSON-ready)."""
    return {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "machine": f"{cpu_name()}, {os.cpu_count()} CPUs, {platform.system()} "
                   f"{platform.machine()}",
        "gpus": [tf.config.experimental.get_device_details(gpu).get("device_name", gpu.name)
                 for gpu in tf.config.list_physical_devices("GPU")],
        "python": platform.python_version(),
        **{name: version(name) for name in ("tensorflow", "keras", "tf_keras", "tfdls")},
        "tfdls_source_sha256": source_digest(),
    }
