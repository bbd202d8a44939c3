"""Fields packed in one variable (`tfdls._packed_state`) save and restore as variables of
their own: the same checkpoint keys, dtypes, shapes and values, both ways, asynchronous
checkpoints included; a SavedModel holds the vector its functions take, and its variables
read as a checkpoint restore it; replicas restore alike."""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tfdls import _packed_state

INT64 = st.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max)


class _Separate(tf.Module):
    """The fields as separate variables, as the overflow record held them before."""

    def __init__(self, values):
        super().__init__()
        for name, value in values.items():
            setattr(self, name, tf.Variable(value))


class _Packed(_packed_state.PackedModule):
    """The fields packed, as `tfdls.overflow.OverflowRecord` packs its own."""

    def __init__(self, values):
        super().__init__()
        self._pack("packed", **values)

    @tf.function(input_signature=[])
    def count(self):
        return self.packed.add(a=1)


def _values(draw_ints, mask, other):
    a, b = draw_ints
    return {"a": np.int64(a), "mask": np.asarray(mask, np.bool_), "b": np.int64(b),
            "other": np.asarray(other, np.bool_)}


def _zeros_like(values):
    return {name: np.zeros_like(value) for name, value in values.items()}


def _assert_equal(found, expected):
    assert set(found) == set(expected)
    for name, value in expected.items():
        assert np.asarray(found[name]).dtype == value.dtype, name
        np.testing.assert_array_equal(found[name], value, err_msg=name)


def checkpoint_contents(path):
    """Per key of the checkpoint at `path`: its dtype and value."""
    reader = tf.train.load_checkpoint(path)
    dtypes = reader.get_variable_to_dtype_map()
    return {key: (dtypes[key], reader.get_tensor(key).tolist())
            for key in reader.get_variable_to_shape_map() if key != "_CHECKPOINTABLE_OBJECT_GRAPH"}


fields = st.tuples(st.tuples(INT64, INT64), st.lists(st.booleans(), max_size=4),
                   st.lists(st.booleans(), max_size=3))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=fields)
def test_packed_fields_save_as_separate_variables_and_back(drawn, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    values = _values(*drawn)
    separate = _Separate(values)
    packed = _Packed(_zeros_like(values))
    packed.packed.assign(**values)
    _assert_equal(packed.packed.numpy(), values)
    # Any subset replaced, the rest kept (one subset per bit pattern of the fields).
    for subset in range(2 ** len(values)):
        chosen = {name: value for i, (name, value) in enumerate(values.items())
                  if subset >> i & 1}
        replaced = packed.packed.replace(tf.zeros([packed.packed.size], tf.int64), **chosen)
        into = _Packed(_zeros_like(values))
        into.state.assign(replaced)
        _assert_equal(into.packed.numpy(), dict(_zeros_like(values), **chosen))
    _assert_equal({n: f.numpy() for n, f in packed.packed.fields.items()}, values)
    # Written by each: the same keys, dtypes and values.
    by_separate = tf.train.Checkpoint(m=separate).write(str(folder / "separate"))
    by_packed = tf.train.Checkpoint(m=packed).write(str(folder / "packed"))
    assert checkpoint_contents(by_packed) == checkpoint_contents(by_separate)
    # Read by the other: every value, every object matched.
    into_packed = _Packed(_zeros_like(values))
    tf.train.Checkpoint(m=into_packed).read(by_separate).assert_consumed()
    _assert_equal(into_packed.packed.numpy(), values)
    into_separate = _Separate(_zeros_like(values))
    tf.train.Checkpoint(m=into_separate).read(by_packed).assert_consumed()
    _assert_equal({n: v.numpy() for n, v in vars(into_separate).items()
                   if isinstance(v, tf.Variable)}, values)


def test_a_restore_before_the_fields_exist_reaches_them(tmp_path):
    """A checkpoint read before its object is attached (the optimizer's record is made
    when it is built) restores the fields when it is."""
    values = _values((7, -1), [True, False], [False])
    path = tf.train.Checkpoint(m=_Separate(values)).write(str(tmp_path / "ckpt"))
    holder = tf.train.Checkpoint()
    status = holder.read(path)
    holder.m = _Packed(_zeros_like(values))
    status.assert_consumed()
    _assert_equal(holder.m.packed.numpy(), values)


def test_a_saved_model_holds_the_vector_its_functions_take(tmp_path):
    values = _values((3, 5), [True], [])
    packed = _Packed(values)
    tf.saved_model.save(packed, str(tmp_path / "model"))
    loaded = tf.saved_model.load(str(tmp_path / "model"))
    assert loaded.count().numpy().tolist() == [4, 1, 5]
    assert loaded.state.numpy().tolist() == [4, 1, 5]


def test_mirrored_replicas_restore_and_count_alike(mirrored_strategy, tmp_path):
    values = _values((11, -3), [False, True, True], [True])
    path = tf.train.Checkpoint(m=_Separate(values)).write(str(tmp_path / "ckpt"))
    with mirrored_strategy.scope():
        packed = _Packed(_zeros_like(values))
    tf.train.Checkpoint(m=packed).read(path).assert_consumed()
    mirrored_strategy.run(tf.function(lambda: packed.packed.add(a=1)))
    expected = dict(values, a=np.int64(12))
    _assert_equal(packed.packed.numpy(), expected)
    for replica_value in mirrored_strategy.experimental_local_results(packed.state):
        assert replica_value.numpy().tolist() == packed.state.numpy().tolist()
    back = _Separate(_zeros_like(values))
    tf.train.Checkpoint(m=back).read(
        tf.train.Checkpoint(m=packed).write(str(tmp_path / "again"))).assert_consumed()
    assert int(back.a.numpy()) == 12


def test_packing_names_what_is_missing_or_not_a_scalar():
    state = _packed_state.PackedState("bad", a=np.int64(0), mask=np.zeros([2], np.bool_))
    with pytest.raises(ValueError, match=r"no fields \['b'\]"):
        state.replace(tf.zeros([3], tf.int64), b=1)
    with pytest.raises(ValueError, match="field 'mask' is not a scalar"):
        state.delta(mask=1)


def test_an_async_checkpoint_holds_the_fields_as_they_were_when_saved(tmp_path):
    values = _values((0, 0), [True], [])
    packed = _Packed(values)
    checkpoint = tf.train.Checkpoint(m=packed)
    options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
    for save in range(3):
        path = checkpoint.save(str(tmp_path / "ckpt"), options=options)
        for _ in range(20):  # the step goes on while the file is written
            packed.count()
        checkpoint.sync()
        reader = tf.train.load_checkpoint(path)
        assert int(reader.get_tensor("m/a/.ATTRIBUTES/VARIABLE_VALUE")) == 20 * save
        assert reader.get_tensor("m/mask/.ATTRIBUTES/VARIABLE_VALUE").tolist() == [True]


def test_a_saved_models_variables_read_as_a_checkpoint_restore_the_vector(tmp_path):
    values = _values((9, -2), [False, True], [True])
    tf.saved_model.save(_Packed(values), str(tmp_path / "model"))
    into = _Packed(_zeros_like(values))
    tf.train.Checkpoint(into).read(str(tmp_path / "model" / "variables" / "variables"))
    _assert_equal(into.packed.numpy(), values)


def test_a_field_of_another_shape_is_refused_naming_it(tmp_path):
    saved = _values((1, 2), [True, False, True], [])
    path = tf.train.Checkpoint(m=_Separate(saved)).write(str(tmp_path / "ckpt"))
    into = _Packed(_values((0, 0), [False, False], []))
    with pytest.raises(ValueError, match=r"shape \(3,\).*field 'mask'.*shape \(2,\)"):
        tf.train.Checkpoint(m=into).read(path)
