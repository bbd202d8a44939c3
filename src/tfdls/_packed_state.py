"""Small state variables as one vector: one argument of every step, the same checkpoint.

A step's function takes every variable it touches as an argument of its own; under
whole-step XLA each written one is read and written back by every call. The overflow
record's seven counters and masks are diagnostics that a finite step leaves alone but for
one counter, so they are fields of one int64 vector here: a finite step adds to one
element, a skipped one writes the vector.

A checkpoint still holds each field under its own name, as the variable it was before
(`Field` saves and restores its slice of the vector): checkpoints written before and since
read alike, `assert_consumed` included. A SavedModel holds the vector itself, which its
functions take (`PackedModule` tracks each for its use).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfdls import _compat
from tfdls._distribute import state_variable


class PackedState:
    """Named int64 and bool fields, scalars or vectors, in one int64 state variable.

    Args:
        name: the variable's name.
        **initial: per field, its initial value (a NumPy int64 or bool scalar or vector):
            its shape and dtype are the field's.

    A `PackedModule` holds one, tracked for checkpoints and SavedModels.

    Example:

    >>> from tfdls._packed_state import PackedState
    >>> state = PackedState("counts", steps=np.int64(0), mask=np.zeros([2], np.bool_))
    >>> _ = state.add(steps=1)
    >>> int(state.numpy()["steps"])
    1
    """

    def __init__(self, name, **initial):
        self._layout = {}  # name -> (start, shape, dtype)
        start = 0
        for field, value in initial.items():
            value = np.asarray(value)
            self._layout[field] = (start, value.shape, tf.as_dtype(value.dtype))
            start += value.size  # a scalar takes one element
        self.size = start
        self.variable = state_variable(name, self._pack_numpy(initial), tf.int64)
        self.fields = {field: Field(self.variable, field, start, shape, dtype)
                       for field, (start, shape, dtype) in self._layout.items()}

    def get(self, vector, field):
        """A read of the vector -> the value of `field` (its dtype and shape)."""
        return _field_value(vector, *self._layout[field])

    def replace(self, vector, **values):
        """A read of the vector -> the vector with the fields in `values` replaced.

        In few operations (the skipped step's record is built every step where both
        outcomes are selected, and its branch's operations cost a step that does not take
        it too): neighbouring fields kept are one slice, neighbouring scalars one stack.
        """
        unknown = set(values) - set(self._layout)
        if unknown:
            raise ValueError(
                f"replace: no fields {sorted(unknown)} (fields: {list(self._layout)})")
        pieces, scalars, kept_from = [], [], None
        for field, (start, shape, _) in self._layout.items():
            if field not in values:
                if kept_from is None:
                    _flush(pieces, scalars)
                    kept_from = start
                continue
            if kept_from is not None:
                pieces.append(vector[kept_from:start])
                kept_from = None
            value = tf.cast(values[field], tf.int64)
            if shape == ():
                scalars.append(value)
            else:
                _flush(pieces, scalars)
                pieces.append(tf.reshape(value, [-1]))
        _flush(pieces, scalars)
        if kept_from is not None:
            pieces.append(vector[kept_from:])
        return pieces[0] if len(pieces) == 1 else tf.concat(pieces, 0)

    def delta(self, **amounts):
        """The constant vector adding `amounts` (Python integers) to their scalar fields."""
        vector = np.zeros([self.size], np.int64)
        for field, amount in amounts.items():
            start, shape, _ = self._layout[field]
            if shape != ():
                raise ValueError(f"delta: field {field!r} is not a scalar (shape {shape})")
            vector[start] += amount
        return tf.constant(vector)

    def add(self, **amounts):
        """Adds `amounts` (Python integers) to their scalar fields, in one write; returns it."""
        return self.variable.assign_add(self.delta(**amounts))

    def assign(self, **values):
        """Writes the fields given (the others as they are), in one write; returns it."""
        return self.variable.assign(self.replace(tf.convert_to_tensor(self.variable), **values))

    def numpy(self):
        """Host read: per field, its value as a NumPy scalar or array."""
        vector = self.variable.numpy()
        return {field: _numpy_value(vector, start, shape, dtype)
                for field, (start, shape, dtype) in self._layout.items()}

    def children(self, children, save_type):
        """The owner's trackable children for `save_type`: a checkpoint the fields (each
        under its own name), a SavedModel the variable."""
        if str(getattr(save_type, "value", save_type)) == "savedmodel":
            fields = set(map(id, self.fields.values()))
            return {name: child for name, child in children.items() if id(child) not in fields}
        return {name: child for name, child in children.items() if child is not self.variable}

    def _pack_numpy(self, values):
        return np.concatenate([np.asarray(values[field], np.int64).reshape([-1])
                               for field in self._layout])


class PackedModule(tf.Module):
    """A `tf.Module` whose state is one `PackedState`, tracked as the module docstring says:
    `state` (the variable) for a SavedModel, and each field, an attribute of the module
    under its own name, for a checkpoint. Subclasses call `_pack` in `__init__`."""

    def _pack(self, name, **initial):
        """Makes the `PackedState` (`self.packed`) of fields `initial` (see `PackedState`)."""
        self.packed = PackedState(name, **initial)
        self.state = self.packed.variable
        for field, value in self.packed.fields.items():
            setattr(self, field, value)  # the field's checkpoint name

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        children = super()._trackable_children(save_type, **kwargs)
        return self.packed.children(children, save_type)

    def _lookup_dependency(self, name, cached_dependencies=None):
        # A SavedModel's variables hold `state`, not the fields: read as a checkpoint into
        # these objects, they restore it.
        found = super()._lookup_dependency(name, cached_dependencies)
        return self.__dict__.get("state") if found is None and name == "state" else found


class Field(_compat.Trackable):
    """One field of a `PackedState`, as a checkpoint sees it: a value of its own dtype and
    shape, saved and restored under the field's own name (a variable's key)."""

    def __init__(self, variable, name, start, shape, dtype):
        self._variable, self._name = variable, name
        self._start, self._shape, self._dtype = start, shape, dtype

    def numpy(self):
        """Host read of the field."""
        return _numpy_value(self._variable.numpy(), self._start, self._shape, self._dtype)

    def _serialize_to_tensors(self):
        value = _field_value(tf.convert_to_tensor(self._variable), self._start, self._shape,
                             self._dtype)
        return {_compat.VARIABLE_VALUE_KEY: value}

    def _restore_from_tensors(self, restored_tensors):
        restored = restored_tensors[_compat.VARIABLE_VALUE_KEY]
        if not restored.shape.is_compatible_with(self._shape):
            raise ValueError(
                f"Received incompatible tensor with shape {restored.shape} when attempting to "
                f"restore the field {self._name!r} of {self._variable.name}, of shape "
                f"{self._shape}: the checkpoint was written for another model or optimizer")
        # A scatter of its own slice, not a read-modify-write of the vector: the fields'
        # restores may run in any order, or together.
        value = tf.reshape(tf.cast(restored, tf.int64), [-1])
        indices = tf.range(self._start, self._start + int(np.prod(self._shape)))
        return self._variable.scatter_update(tf.IndexedSlices(value, indices))

    def _copy_trackable_to_cpu(self, object_map):
        # An async checkpoint saves copies made when `save()` is called: the field of a copy
        # of the vector, which every field copies again (one value: one call copies all).
        self._variable._copy_trackable_to_cpu(object_map)
        if self not in object_map:
            object_map[self] = Field(object_map[self._variable], self._name, self._start,
                                     self._shape, self._dtype)


def _flush(pieces, scalars):
    """Moves the scalars gathered so far into `pieces`, as one vector."""
    if scalars:
        pieces.append(tf.stack(scalars))
        scalars.clear()


def _field_value(vector, start, shape, dtype):
    value = vector[start] if shape == () else tf.reshape(
        vector[start:start + int(np.prod(shape))], shape)
    return value if dtype == tf.int64 else tf.cast(value, dtype)


def _numpy_value(vector, start, shape, dtype):
    return vector[start:start + int(np.prod(shape))].reshape(shape).astype(dtype.as_numpy_dtype)
