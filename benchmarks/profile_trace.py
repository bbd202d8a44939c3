"""Reads TensorFlow profiler traces (``*.xplane.pb``) and counts device-to-host copies.

Used by gpu_check.py; see benchmarks/README.md ("GPU check", device_to_host).
"""

import glob
import importlib
import importlib.util
import os


def xspace_class():
    """The XSpace protobuf class shipped inside the installed TensorFlow.

    Its module moved between releases, so known locations are tried first,
    then the tensorflow package is searched for ``xplane_pb2.py``.
    """
    for name in ("tensorflow.tsl.profiler.protobuf.xplane_pb2",
                 "tsl.profiler.protobuf.xplane_pb2",
                 "tensorflow.core.profiler.protobuf.xplane_pb2"):
        try:
            return importlib.import_module(name).XSpace
        except ImportError:
            continue
    import tensorflow as tf  # only to find its package directory

    root = os.path.dirname(tf.__file__)
    for path in sorted(glob.glob(os.path.join(root, "**", "xplane_pb2.py"), recursive=True)):
        spec = importlib.util.spec_from_file_location("_tfdls_bench_xplane_pb2", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.XSpace
    raise ImportError(f"no xplane_pb2 module under {root}")


def find_trace(logdir):
    """The newest ``*.xplane.pb`` the profiler wrote under `logdir`."""
    paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb under {logdir}")
    return max(paths, key=os.path.getmtime)


# Lines the profiler derives from others (they repeat events under op names).
DERIVED_LINES = {"XLA Modules", "XLA Ops", "TensorFlow Ops", "TensorFlow Name Scope", "Steps",
                 "Source", "Launch Stats", "XLA TraceMe"}


def is_device_to_host(name):
    """Whether an event name is a device-to-host copy: "MemcpyD2H", "memcpy DtoH",
    or a driver call such as "cuMemcpyDtoHAsync_v2"."""
    key = "".join(c for c in name.lower() if c.isalnum())
    return "memcpyd2h" in key or "memcpydtoh" in key


def count_events(path):
    """Counts the events of one profiler trace.

    Args:
        path: an ``*.xplane.pb`` file.

    Returns:
        A dict: trace, planes (names), host_events, device_events (events on
        ``/device:*`` planes outside derived lines), device_to_host (copy
        events on GPU planes), host_device_to_host_calls (driver calls on the
        host planes, a cross-check) and memcpy_names (every event name on GPU
        planes containing "memcpy", with counts, to check the matcher).
    """
    space = xspace_class()()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    counts = {"trace": path, "planes": [], "host_events": 0, "device_events": 0,
              "device_to_host": 0, "host_device_to_host_calls": 0, "memcpy_names": {}}
    for plane in space.planes:
        counts["planes"].append(plane.name)
        is_host = plane.name.startswith("/host:")
        is_device = plane.name.startswith("/device:")
        is_gpu = plane.name.startswith("/device:GPU")
        for line in plane.lines:
            if is_device and line.name in DERIVED_LINES:
                continue
            for event in line.events:
                metadata = plane.event_metadata[event.metadata_id]
                name = metadata.name or metadata.display_name
                # Either name may carry the copy kind; one event counts once.
                copy = is_device_to_host(metadata.name) or is_device_to_host(
                    metadata.display_name)
                if is_host:
                    counts["host_events"] += 1
                    counts["host_device_to_host_calls"] += copy
                elif is_device:
                    counts["device_events"] += 1
                if is_gpu:
                    counts["device_to_host"] += copy
                    if "memcpy" in name.lower():
                        counts["memcpy_names"][name] = counts["memcpy_names"].get(name, 0) + 1
    return counts
