"""The finiteness check: is every gradient free of NaN and Inf?

This decides whether a step is skipped, so it must be exact (a finite value,
however large, is never reported non-finite; any NaN or Inf is) and cheap (it
reads every gradient on every step). It has no branch: the step never waits
for the host to learn the answer.

Per gradient it uses one of two exact reductions:

* ``all(is_finite(g))``, the definition itself;
* on hosts without an accelerator, for float32/float64 tensors with a wide
  enough inner dimension: ``is_finite(sum(g @ w))``, a matrix-vector product
  with a constant weight ``w = 2**-k`` (``2**k >= 16 * size``). A finite
  gradient gives a finite result: every product is at most
  ``max_float * 2**-k``, so no partial sum can overflow whatever the order of
  summation; a NaN or Inf propagates through multiply and add. CPU matrix
  products are plain IEEE arithmetic, and XLA's CPU backend runs them as a
  vectorized, multi-threaded GEMV, where it emits a fused ``is_finite``
  reduction as a slower scalar loop (measured: about half the time on 24
  1024x1024 gradients). Accelerators (and CPUs whose oneDNN is allowed a
  lower-precision "fpmath mode") may round matmul inputs (TF32, bfloat16
  passes), which could turn a value within a few ulp of the float32 maximum
  into Inf, so they always take the first form.

Inside XLA, small gradients of one dtype and shape (a deep model's equal
layers) are stacked and reduced together, each still answered for itself
(`STACK_MAX_ELEMENTS`): one reduction per shape instead of one per gradient,
and XLA fuses the stack into the reduction (not into the matrix-vector form's
dot: there XLA's CPU backend copies the stack, about 5 µs per 64x64 gradient
per step, which is kept because a product per gradient costs every compile 30
to 100 ms per gradient; docs/benchmarks.md, session 24). Outside XLA each
gradient is read alone: there a stack is a copy of its members every step,
which costs more than the reductions it saves (the check, `finite_flags`, and
the magnitudes the scale boundaries read, `largest_magnitudes`, alike).
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from tfdls import _compat, _distribute

# Below these sizes the matrix-vector form has no advantage (measured on a
# 2-core CPU: graph mode prefers is_finite for 64x64 gradients, XLA does not).
_MATVEC_MIN_SIZE_XLA = 1024
_MATVEC_MIN_SIZE_GRAPH = 65536
_MATVEC_MIN_WIDTH = 16


def gradient_values(grads: Any) -> list[tf.Tensor]:
    """Flattens a nest of gradients into a list of dense value tensors.

    `None` entries (variables without a gradient) are dropped and
    `tf.IndexedSlices` contribute their `values`, which are the only numbers
    they hold.
    """
    values = []
    for grad in tf.nest.flatten(grads, expand_composites=False):
        if grad is None:
            continue
        if isinstance(grad, tf.IndexedSlices):
            grad = grad.values
        values.append(tf.convert_to_tensor(grad))
    return values


def _check_floating(values):
    for value in values:
        if not value.dtype.is_floating:
            raise TypeError(
                "Gradients must be floating point; got a gradient of dtype "
                f"{value.dtype.name}: {value!r}"
            )


# Environment variables that let oneDNN compute float32 matmuls with less
# precision (bfloat16, TF32 passes); unset or STRICT keeps IEEE float32.
# oneDNN documents ANY as allowing any down-conversion.
FPMATH_VARIABLES = ("ONEDNN_DEFAULT_FPMATH_MODE", "TF_SET_ONEDNN_FPMATH_MODE")


def accelerator_visible() -> bool:
    """True where TensorFlow sees a GPU or TPU."""
    return bool(tf.config.list_physical_devices("GPU") or tf.config.list_physical_devices("TPU"))


def host_only() -> bool:
    """True when no accelerator can run the check and float32 matmuls are strict IEEE."""
    if accelerator_visible():
        return False
    return all(
        os.environ.get(name, "").strip().upper() in ("", "STRICT") for name in FPMATH_VARIABLES
    )


def matvec_width(value: tf.Tensor, in_xla: bool, max_width: int = 4096) -> int | None:
    """Inner width for a matrix-vector form of `value`, or None where it does not pay.

    Used by the check here and by `tfdls.gradient_stats`.
    """
    if value.dtype not in (tf.float32, tf.float64) or not value.shape.is_fully_defined():
        return None
    size = value.shape.num_elements()
    if size < (_MATVEC_MIN_SIZE_XLA if in_xla else _MATVEC_MIN_SIZE_GRAPH):
        return None
    last = value.shape[-1] if value.shape.rank else 0
    if _MATVEC_MIN_WIDTH <= last <= max_width:
        return last
    # Otherwise the largest power-of-two divisor of the size that fits.
    width = 1 << (max_width.bit_length() - 1)
    while width >= _MATVEC_MIN_WIDTH:
        if size % width == 0:
            return width
        width //= 2
    return None


def _matvec_flag(value, width, batched=False):
    # `batched`: `value` stacks tensors along its first axis; a flag per tensor.
    size = value.shape[1:].num_elements() if batched else value.shape.num_elements()
    # 2**k >= 16 * size leaves a factor 16 for rounding growth in any
    # summation order (at most (1 + 2**-24)**size, < 8 for size < 2**25 and
    # far smaller for the blocked sums BLAS and XLA use).
    k = math.ceil(math.log2(size)) + 4
    weight = tf.fill([width], tf.constant(2.0**-k, value.dtype))
    rows = tf.linalg.matvec(tf.reshape(value, [value.shape[0], -1, width] if batched
                                       else [-1, width]), weight)
    return tf.math.is_finite(tf.reduce_sum(rows, axis=-1 if batched else None))


def _exact_flag(value, batched=False):
    return tf.reduce_all(tf.math.is_finite(value), axis=_inner_axes(value) if batched else None)


def _inner_axes(stacked):
    return list(range(1, stacked.shape.rank))


# Inside XLA, tensors of at most this many elements that share a dtype, shape and device
# are reduced together, stacked along a new first axis: one reduction for all
# of them instead of one each (a model of many equal layers traced, and XLA
# compiled, a reduction per gradient; 100 Dense(64) layers have 200
# gradients of 2 shapes). Every reduction here is exact in any order, so a
# stacked tensor's answers are bit for bit each tensor's own. Larger tensors
# are reduced alone: stacking would copy them.
STACK_MAX_ELEMENTS = 32768
# And at most this many tensors per stack. XLA's CPU backend emits a stack (a
# concatenate) element by element, in time that grows faster than its number
# of operands: 100 Dense(64) biases stacked took 1.0 s of LLVM to compile,
# in stacks of 16 0.02 s each. A long run of equal tensors is read 16 at a time.
STACK_MAX_MEMBERS = 16


class _Unit:
    """What one reduction reads: the tensor `first` alone, or tensors `members`
    (indices into the list given) stacked along a new first axis (`batched`); `first`
    is the first of them (its dtype and shape are every member's)."""

    def __init__(self, members, value, first):
        self.members, self.value, self.first = members, value, first

    @property
    def batched(self):
        return len(self.members) > 1


def _units(values, in_xla):
    """The reductions that read `values`: inside XLA (`in_xla`) small tensors of one
    dtype, shape and device stacked, every other tensor alone."""
    groups = {}
    for i, value in enumerate(values):
        size = value.shape.num_elements()
        key = (("stack", value.dtype, tuple(value.shape.as_list()), value.device)
               if in_xla and size and size <= STACK_MAX_ELEMENTS else ("alone", i))
        groups.setdefault(key, []).append(i)
    chunks = [group[start:start + STACK_MAX_MEMBERS] for group in groups.values()
              for start in range(0, len(group), STACK_MAX_MEMBERS)]
    return [_Unit(members, values[members[0]] if len(members) == 1
                  else tf.stack([values[i] for i in members]), values[members[0]])
            for members in chunks]


def _in_order(units, results):
    """A vector over the values given to `_units` from one result per unit (a scalar for
    a tensor alone, a vector for a stack)."""
    if all(not unit.batched for unit in units):
        return tf.stack(results)
    parts = _parts(units, results)
    order = [i for members, _ in parts for i in members]
    return tf.gather(tf.concat([vector for _, vector in parts], 0),
                     np.argsort(order).astype(np.int32))


def _parts(units, results):
    """``(members, vector)`` pairs from one result per unit: each stack's vector, and the
    scalars of the tensors alone stacked per dtype (no element is sliced out: under XLA
    every slice of a vector is a kernel of its own)."""
    alone = {}
    parts = []
    for unit, result in zip(units, results):
        if unit.batched:
            parts.append((unit.members, result))
        else:
            alone.setdefault(result.dtype, []).append((unit.members[0], result))
    for pairs in alone.values():
        parts.append(([i for i, _ in pairs], tf.stack([r for _, r in pairs])))
    return parts


def _finite_flag(unit, in_xla, on_host):
    """The unit's finiteness flag(s), exactly (see the module docstring)."""
    width = matvec_width(unit.first, in_xla) if on_host else None
    if width is None:
        return _exact_flag(unit.value, unit.batched)
    return _matvec_flag(unit.value, width, unit.batched)


def finite_flags(values: Sequence[tf.Tensor]) -> tf.Tensor:
    """Returns a bool vector: entry `i` is True iff `values[i]` is all finite.

    Args:
        values: a list of dense float tensors (see `gradient_values`).

    Exact and branch-free (see the module docstring); each tensor is read
    once (inside XLA, small ones of one shape together, `STACK_MAX_ELEMENTS`).
    """
    _check_floating(values)
    if not values:
        return tf.ones([0], tf.bool)
    in_xla = _compat.in_xla_context()
    on_host = host_only()
    # Stacked only inside XLA, which fuses the stack into the reduction. Outside, a
    # stack is a copy of its members every step: a 24-layer MLP's step in graph mode
    # took 1.43x the bare optimizer's with stacks, 1.27x without (Keras 3: 1.25x).
    units = _units(values, in_xla)
    return _in_order(units, [_finite_flag(u, in_xla, on_host) for u in units])


def largest_magnitudes(values: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """Per tensor, its largest magnitude in its own dtype: +inf if it holds a NaN or Inf, 0 if empty.

    Args:
        values: a list of dense float tensors (see `gradient_values`).

    One reading answers both "is it finite?" and "how large is it?", exactly:
    inside XLA, from the bits (`_largest_magnitude_from_bits`: an integer
    maximum, which no NaN rule affects) or, for large float32/float64
    tensors, one fused reduction of ``|x|`` with NaN replaced by +inf first
    (so the answer never depends on how a maximum treats NaN); elsewhere
    `finite_flags`' reduction decides finiteness and a maximum and a minimum,
    which only read, give the largest magnitude of a finite tensor. Inside
    XLA small tensors of one shape are read together (`STACK_MAX_ELEMENTS`). Scaling
    is monotonic, so ``largest / divisor`` is finite exactly when every
    element's quotient is (see
    `LossScaleOptimizer` with scale boundaries). Float maxima on CPUs compare
    subnormals as zeros (outside XLA, and XLA's float form): a tensor whose
    largest magnitude is subnormal may read as any of its subnormal
    magnitudes, or 0.

    Example:

    >>> [float(m) for m in tfdls.finite.largest_magnitudes(
    ...     [tf.constant([1.0, -3.0]), tf.constant([2.0, float("nan")]), tf.zeros([0])])]
    [3.0, inf, 0.0]
    """
    _check_floating(values)
    in_xla = _compat.in_xla_context()
    on_host = host_only()
    out = [None] * len(values)
    for unit in _units(values, in_xla):
        largest = _largest_magnitude(unit, in_xla, on_host)
        for i, r in zip(unit.members, tf.unstack(largest, len(unit.members))
                        if unit.batched else [largest]):
            out[i] = r
    return out


def largest_magnitude_parts(values: Sequence[tf.Tensor]) -> list[tuple[list[int], tf.Tensor]]:
    """`largest_magnitudes` as vectors: a list of ``(indices into values, vector)``, each
    vector one dtype's, in no particular order.

    Args:
        values: a list of dense float tensors (see `gradient_values`).

    For a caller that reads the magnitudes as vectors anyway (the scale
    boundaries' check): no magnitude is sliced out of its reduction's result.
    """
    _check_floating(values)
    in_xla = _compat.in_xla_context()
    on_host = host_only()
    units = _units(values, in_xla)
    return _parts(units, [_largest_magnitude(u, in_xla, on_host) for u in units])


def _largest_magnitude(unit, in_xla, on_host):
    value, batched = unit.value, unit.batched
    axis = _inner_axes(value) if batched else None
    if in_xla:
        if batched or _bits_pay(value):  # a stack's members are small: the bits pay
            return _largest_magnitude_from_bits(value, axis)
        inf = tf.constant(float("inf"), value.dtype)
        return _floor_at_zero(tf.reduce_max(tf.where(tf.math.is_nan(value), inf,
                                                     tf.abs(value))), value)
    # The abs, after the floor (an empty tensor's -inf must read 0): TensorFlow's
    # CPU kernels compare subnormals as zeros, so the maximum may pick the
    # negated minimum's negative twin. (A stack's members are not empty.)
    largest = tf.maximum(tf.reduce_max(value, axis), -tf.reduce_min(value, axis))
    if not batched:
        largest = _floor_at_zero(largest, value)
    return tf.where(_finite_flag(unit, in_xla, on_host), tf.abs(largest),
                    tf.constant(float("inf"), value.dtype))


# dtype -> (the integer type of its bits, the bits of +inf).
_BITS = {
    tf.float16: (tf.int16, 0x7C00),
    tf.bfloat16: (tf.int16, 0x7F80),
    tf.float32: (tf.int32, 0x7F800000),
    tf.float64: (tf.int64, 0x7FF0000000000000),
}


def _bits_pay(value):
    # Both forms are exact. Measured under XLA on a 2-core CPU: the bits are
    # faster for float16 and bfloat16 at every size (XLA's CPU backend
    # computes their float maximum element by element in float32), and for
    # float32/float64 up to about 32768 elements; above, the float form's
    # one fused pass beats the bits form's extra write of the masked bits.
    size = value.shape.num_elements()
    return value.dtype in (tf.float16, tf.bfloat16) or size is None or size <= 32768


def _largest_magnitude_from_bits(value, axis=None):
    # With the sign bit cleared, an IEEE value's bits, read as an integer,
    # order as its magnitude does, +inf above every finite value and every
    # NaN above +inf: the largest magnitude is the integer maximum, NaN
    # clipped to +inf (0 for an empty tensor).
    int_type, inf_bits = _BITS[value.dtype]
    sign_cleared = tf.bitwise.bitwise_and(tf.bitcast(value, int_type),
                                          tf.constant((1 << (int_type.size * 8 - 1)) - 1, int_type))
    largest = tf.clip_by_value(tf.reduce_max(sign_cleared, axis), tf.constant(0, int_type),
                               tf.constant(inf_bits, int_type))
    return tf.bitcast(largest, value.dtype)


def _floor_at_zero(largest, value):
    # An empty tensor's maximum is -inf: its largest magnitude is 0. Only
    # where the size is unknown does this cost an operation (XLA would not
    # fuse it into the reduction).
    size = value.shape.num_elements()
    if size is None:
        return tf.maximum(largest, tf.zeros([], value.dtype))
    return largest if size else tf.zeros([], value.dtype)


def sum_bounds(grads: Sequence[Any]) -> tuple[tf.Tensor, tf.Tensor]:
    """Per gradient, a bound of every sum an optimizer forms of its elements, and how many terms
    such a sum has (two float64 vectors, this replica's).

    Args:
        grads: dense tensors or `tf.IndexedSlices` (float values), as they
            will be applied.

    A dense gradient's elements are applied as they are: the bound is its
    largest magnitude (`largest_magnitudes`), one term. An optimizer adds
    the rows of an `IndexedSlices` gradient that share an index (a
    scatter-add, or the dense gradient's segment sum), in no fixed order (on
    a GPU, atomics); the magnitudes an element's sum adds there total at
    most the sum of those rows' largest magnitudes (`sums_may_overflow`
    allows for the rounding of its partial sums): the bound is the largest
    such sum over the indices, its terms the most rows one index has. Reads
    the rows once more and sorts the indices; never densifies.
    """
    bounds, terms = [], []
    dense = [g for g in grads if not isinstance(g, tf.IndexedSlices)]
    dense_largest = iter(largest_magnitudes(dense))
    for grad in grads:
        if not isinstance(grad, tf.IndexedSlices):
            bounds.append(tf.cast(next(dense_largest), tf.float64))
            terms.append(tf.constant(1.0, tf.float64))
            continue
        values, indices = grad.values, grad.indices
        _check_floating([values])
        width = values.shape[1:].num_elements()
        if width is None:
            width = tf.reduce_prod(tf.shape(values)[1:])
        rows = tf.reshape(tf.abs(values), tf.stack([tf.shape(values)[0], width]))
        # A row's largest magnitude (0 for a row without elements); a NaN
        # row makes the step non-finite anyway.
        row_largest = tf.maximum(tf.cast(tf.reduce_max(rows, axis=1), tf.float64), 0.0)
        # Rows sorted by index: a run of equal indices is one segment.
        count = tf.size(indices)
        order = tf.argsort(indices)
        ordered = tf.gather(indices, order)
        position = tf.range(count)
        previous = tf.gather(ordered, tf.maximum(position - 1, 0))
        starts = tf.logical_or(tf.equal(position, 0), tf.not_equal(ordered, previous))
        segment = tf.cumsum(tf.cast(starts, tf.int32)) - 1
        sums = tf.math.unsorted_segment_sum(tf.gather(row_largest, order), segment, count)
        per_index = tf.math.unsorted_segment_sum(tf.ones_like(row_largest), segment, count)
        # Empty slices: no sum (the maxima of nothing are floored at 0).
        bounds.append(tf.maximum(tf.reduce_max(tf.concat([sums, [0.0]], 0)), 0.0))
        terms.append(tf.reduce_max(tf.concat([per_index, [1.0]], 0)))
    return tf.stack(bounds), tf.stack(terms)


def sums_may_overflow(grads: Sequence[Any], across_replicas: bool = False,
                      extra_bounds: Sequence[tf.Tensor] | None = None) -> tf.Tensor:
    """Per gradient: could a sum the optimizer forms from it overflow its dtype? (a bool vector)

    Args:
        grads: dense tensors or `tf.IndexedSlices` (float values), as they
            will be applied.
        across_replicas: the strategy's replicas sum their gradients before
            applying them: bound the sum of the replicas' sums (one float64
            all-reduce), the same answer on every replica.
        extra_bounds: per gradient, a float64 magnitude added to the sum as
            one more term (a gradient accumulator's largest element), or None.

    The rule: with n the terms (the most rows one index has, summed over
    the R replicas, plus E = 1 for an extra bound, else E = 0), u the
    dtype's unit roundoff and B the bound of `sum_bounds` (summed over the
    replicas, plus the extra one), True where

        B * min((1 + u)**(n - 1), 2 * (1 + u)**(ceil(log2(n)) + R - 1 + E)) > largest finite

    Why: rounding to nearest, fl(a + b) is no farther from a + b than a is
    (a is a candidate), so |fl(a + b)| <= |a| + 2|b|, and adding the terms one
    at a time, in any order, keeps every partial sum within 2 * sum |x_i|
    <= 2B. Every addition also grows a sum by at most 1 + u, in any order or
    tree: the first factor. The second allows balanced blocks added first
    (TensorFlow's GPU segment sums), then the replicas' totals and the extra
    term added in any order. A sum within largest rounds to a finite value
    (Inf needs largest + half an ulp); a wider dtype only helps.
    Conservative: a sum that would just fit, or large elements in different
    places, may be reported; a single dense gradient and a bound of 0 never
    are, and many tiny rows at one index (a padding id) are not.

    Example:

    >>> rows = tf.IndexedSlices(tf.constant([[40000.0], [40000.0], [1.0]], tf.float16),
    ...                         tf.constant([3, 3, 5]), tf.constant([8, 1]))
    >>> tfdls.finite.sums_may_overflow([rows, tf.constant([65504.0], tf.float16)]).numpy()
    array([ True, False])
    """
    if not grads:
        return tf.zeros([0], tf.bool)
    bounds, terms = sum_bounds(grads)
    replicas, extra = 1, 0.0
    if across_replicas:
        both = _distribute.sum_over_replicas(tf.stack([bounds, terms]))  # one all-reduce
        bounds, terms = both[0], both[1]
        replicas = _distribute.replicas_in_sync()
    if extra_bounds is not None:
        bounds = bounds + tf.stack(extra_bounds)
        terms = terms + 1.0
        extra = 1.0
    dtypes = [(g.values if isinstance(g, tf.IndexedSlices) else g).dtype for g in grads]
    largest = tf.constant([_FLOAT_INFO[d][0] for d in dtypes], tf.float64)
    log_rounding = tf.constant([math.log1p(2.0 ** -_FLOAT_INFO[d][1]) for d in dtypes],
                               tf.float64)
    # Any order or tree of n - 1 additions: (1 + u)**(n - 1) (each sum at most 1 + u times
    # its operands' magnitudes). One at a time: 2, since |fl(a + b) - (a + b)| <= |b| (a is
    # representable, the nearest value no farther). TensorFlow's GPU segment sums add
    # balanced blocks of rows (depth <= ceil(log2(n))) or runs of 8 before adding the
    # results one at a time, and the replicas' totals and the accumulator come after, in
    # any order: 2 * (1 + u)**(ceil(log2(n)) + R - 1 + E) covers them all. (Runs of 8 grow
    # by (1 + u)**7, within that depth for n > 64; for n <= 64 the first factor is the
    # smaller, below 2 in every dtype.)
    depth = tf.math.ceil(tf.math.log(terms) / math.log(2.0))  # ceil(log2(n)); one above
    # at a power of two where the quotient rounds up: only more conservative.
    log_growth = tf.minimum((terms - 1.0) * log_rounding,
                            math.log(2.0) + (depth + (replicas - 1 + extra)) * log_rounding)
    # The float64 roundings of the bound (at most n - 1 additions) and of this limit, which
    # matter for float64 gradients only (others have half an ulp of their own to spare);
    # none where there is no addition, so a lone largest finite value is never reported.
    log_growth += (terms - 1.0) * 2.0**-48
    # As a limit on the bound: no NaN from inf * 0, and a bound of 0 is never reported,
    # however many terms.
    limits = largest * tf.exp(-log_growth)
    return tf.logical_not(bounds <= limits)  # NaN or Inf: may overflow too


def accumulated_sums_finite(grads: Sequence[Any], accumulators: Sequence[Any]) -> tf.Tensor:
    """Per gradient: is ``accumulator + gradient`` finite? (a bool vector, this replica's)

    Args:
        grads: dense tensors or `tf.IndexedSlices`, as they will be applied.
        accumulators: per gradient, the inner optimizer's gradient accumulator
            (``gradient_accumulation_steps``).

    Keras adds each micro-batch's gradient to its accumulator, in the
    accumulator's dtype, and applies ``(gradient + accumulator) / steps``:
    the same addition, so this is exactly whether the window's sum stays
    finite. An `IndexedSlices` gradient is made dense here, as Keras does to
    add it.
    """
    sums = [tf.convert_to_tensor(a) + tf.cast(tf.convert_to_tensor(g), a.dtype)
            for g, a in zip(grads, accumulators)]
    return finite_flags(sums)


# dtype -> (largest finite value, significand bits).
_FLOAT_INFO = {
    tf.float16: (65504.0, 11),
    tf.bfloat16: (3.3895313892515355e38, 8),
    tf.float32: (3.4028234663852886e38, 24),
    tf.float64: (1.7976931348623157e308, 53),
}


def nonfinite_counts(values: Sequence[tf.Tensor], across_replicas: bool = False) -> tf.Tensor:
    """Per tensor, how many replicas saw a NaN/Inf in it (float32 vector).

    Args:
        values: a list of dense float tensors (see `gradient_values`).
        across_replicas: all-reduce the counts over the replicas of the
            current strategy (in replica context), so that every replica gets
            the same vector. Without a multi-replica strategy the counts are
            this replica's 0.0/1.0 flags.
    """
    local = tf.cast(tf.logical_not(finite_flags(values)), tf.float32)
    return _distribute.sum_over_replicas(local) if across_replicas else local


def all_finite(grads: Any, across_replicas: bool = False) -> tf.Tensor:
    """Returns a scalar bool tensor: `True` iff every gradient is finite.

    Args:
        grads: a tensor, a list, or any nest of tensors, `tf.IndexedSlices`
            and `None`. Float dtypes may be mixed in one call.
        across_replicas: under a `tf.distribute` strategy with several
            replicas, answer for all replicas together (one all-reduce), so
            that every replica decides the same. In replica context `grads`
            are this replica's gradients; in cross-replica context they may be
            per-replica values. Without a strategy it changes nothing.

    Returns:
        A scalar `tf.bool` tensor. With no gradients at all it is `True`.

    Example:

    >>> tfdls.all_finite([tf.constant([1.0, 2.0]), None])
    <tf.Tensor: shape=(), dtype=bool, numpy=True>
    >>> tfdls.all_finite({"w": tf.constant([1.0, float("nan")])})
    <tf.Tensor: shape=(), dtype=bool, numpy=False>
    >>> tfdls.all_finite([tf.constant(3e38), tf.constant(3e38)])  # no overflow
    <tf.Tensor: shape=(), dtype=bool, numpy=True>

    Nothing is read back to the host and there is no branch, so it is safe and
    cheap inside `tf.function` and XLA.
    """
    if across_replicas and _distribute.in_cross_replica_context():
        count = _distribute.sum_of_per_replica(
            lambda g: tf.reduce_sum(nonfinite_counts(gradient_values(g))), grads
        )
        return tf.equal(count, 0.0)
    counts = nonfinite_counts(gradient_values(grads), across_replicas)
    return tf.equal(tf.reduce_sum(counts), 0.0)
