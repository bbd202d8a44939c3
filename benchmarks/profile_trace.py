"""Reads a TensorFlow profiler trace (``*.xplane.pb``) and counts device-to-host copies.

Used by test_gpu.py; see benchmarks/README.md ("GPU tests").
"""

import glob
import importlib
import importlib.util
import os

# Lines the profiler derives from others (they repeat events under op names).
DERIVED_LINES = {"XLA Modules", "XLA Ops", "TensorFlow Ops", "TensorFlow Name Scope", "Steps",
                 "Source", "Launch Stats", "XLA TraceMe"}


def xspace_class():
    """The XSpace protobuf class inside the installed TensorFlow (its module moved between
    releases: the known places first, then any ``xplane_pb2.py`` in the package)."""
    for name in ("tensorflow.tsl.profiler.protobuf.xplane_pb2",
                 "tsl.profiler.protobuf.xplane_pb2",
                 "tensorflow.core.profiler.protobuf.xplane_pb2"):
        try:
            return importlib.import_module(name).XSpace
        except ImportError:
            continue
    root = os.path.dirname(importlib.import_module("tensorflow").__file__)
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


def is_device_to_host(name):
    """Whether an event name is a device-to-host copy: "MemcpyD2H", "memcpy DtoH", or a
    driver call such as "cuMemcpyDtoHAsync_v2"."""
    key = "".join(c for c in name.lower() if c.isalnum())
    return "memcpyd2h" in key or "memcpydtoh" in key


def count_events(path):
    """Counts the events of one profiler trace.

    Args:
        path: an ``*.xplane.pb`` file.

    Returns:
        A dict: planes (names), host_events, device_events (on ``/device:*``
        planes, derived lines left out), device_to_host (copies on GPU planes),
        host_device_to_host_calls (driver calls on host planes, a cross-check)
        and memcpy_names (every event name with "memcpy" on GPU planes, counted,
        to check the matcher).
    """
    space = xspace_class()()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    counts = {"planes": [], "host_events": 0, "device_events": 0, "device_to_host": 0,
              "host_device_to_host_calls": 0, "memcpy_names": {}}
    for plane in space.planes:
        counts["planes"].append(plane.name)
        is_host, is_device = plane.name.startswith("/host:"), plane.name.startswith("/device:")
        for line in plane.lines:
            if is_device and line.name in DERIVED_LINES:
                continue
            for event in line.events:
                meta = plane.event_metadata[event.metadata_id]
                name = meta.name or meta.display_name
                # Either name may carry the copy kind; one event counts once.
                copy = is_device_to_host(meta.name) or is_device_to_host(meta.display_name)
                counts["host_events"] += is_host
                counts["host_device_to_host_calls"] += is_host and copy
                counts["device_events"] += is_device
                if plane.name.startswith("/device:GPU"):
                    counts["device_to_host"] += copy
                    if "memcpy" in name.lower():
                        counts["memcpy_names"][name] = counts["memcpy_names"].get(name, 0) + 1
    return counts
