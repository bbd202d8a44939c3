"""Which cases the fast loop (``python -m pytest -m "not slow"``) runs.

CI runs every test. The fast loop keeps, for each parametrized test, the
cases named here and marks the others ``slow``, so that it finishes in a few
minutes on two cores (README gives measured times) and still runs every module.
"""

import pytest


def slow_except(values, keep, ids=None):
    """`values` as pytest params, every one not in `keep` marked slow.

    Args:
        values: the parameter values (tuples for several argnames).
        keep: the values the fast loop runs.
        ids: optional ids, one per value.
    """
    params = []
    for i, value in enumerate(values):
        marks = () if value in keep else pytest.mark.slow
        params.append(pytest.param(*(value if isinstance(value, tuple) else (value,)),
                                   marks=marks, id=None if ids is None else ids[i]))
    return params
