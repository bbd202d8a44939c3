"""Keras' own LossScaleOptimizer tests, run against tfdls.LossScaleOptimizer.

The module is imported from the installed Keras at test time (it ships as
`keras.src.optimizers.loss_scale_optimizer_test`), its global name
`LossScaleOptimizer` is replaced by tfdls' class, and each of its test
methods runs here as one pytest case. A difference tfdls has on purpose is an
expected failure (strict, so that it is noticed when it goes away) that names
its reason, and must fail the way that reason says; every other case must
pass. Keras skips its `stateless_apply` cases on the TensorFlow backend (its
own class does not support them there either); those skips are passed on.
"""

import importlib
import re
import unittest

import pytest

import tfdls

keras_tests = importlib.import_module("keras.src.optimizers.loss_scale_optimizer_test")


def _keras_test_case():
    # Not bound to a module-level name: pytest would collect the TestCase
    # subclass and run Keras' tests a second time, against Keras' own class.
    return keras_tests.LossScaleOptimizerTest


class ByDesign(AssertionError):
    """A Keras test failed the way a documented tfdls difference says it does."""


# test name -> (why tfdls differs on purpose, a pattern its failure must match).
# README's "Migrating" section lists the same differences.
BY_DESIGN = {
    "test_finite_step_with_inner_loss_scale_stateful": (
        "tfdls refuses an inner optimizer with its own loss_scale_factor (it would scale "
        "the loss twice); Keras silently resets it to None",
        r"ValueError: `inner_optimizer` has its own loss_scale_factor=100",
    ),
    "test_init_dynamic_arg": (
        "tfdls takes dynamic=False as a fixed scale of initial_scale (as tf_keras did); "
        "Keras 3 raises",
        r"ValueError not raised",
    ),
    "test_serialization": (
        "tfdls' config has more keys (the loss scale's own config, overflow attribution, "
        "min_scale_policy, jit_compile, gradient_stats) than Keras' four",
        r"AssertionError: \d+ != 4\b",
    ),
    "test_init_base_optimizer_unsupported_args_loss_scale_factor": (
        "tfdls refuses loss_scale_factor on the inner optimizer too, so its error points "
        "to the wrapper's loss_scale= instead of to the inner optimizer",
        r"does not match.*loss_scale_factor=0\.5",
    ),
}


def _cases():
    for name in unittest.defaultTestLoader.getTestCaseNames(_keras_test_case()):
        marks = ()
        if name in BY_DESIGN:
            marks = pytest.mark.xfail(reason=BY_DESIGN[name][0], raises=ByDesign, strict=True)
        yield pytest.param(name, marks=marks, id=name)


def test_the_module_is_keras_own_and_has_its_tests():
    assert keras_tests.__name__.startswith("keras.")
    names = unittest.defaultTestLoader.getTestCaseNames(_keras_test_case())
    # Guards against a Keras release that renames or drops the tests, which
    # would otherwise leave nothing (or an xfail for nothing) to run here.
    assert len(names) >= 29, names
    assert set(BY_DESIGN) <= set(names)


@pytest.mark.parametrize("name", list(_cases()))
def test_keras_loss_scale_optimizer_test(name, monkeypatch):
    monkeypatch.setattr(keras_tests, "LossScaleOptimizer", tfdls.LossScaleOptimizer)
    result = unittest.TestResult()
    _keras_test_case()(name).run(result)
    if result.skipped:
        (_, reason), = result.skipped
        assert "stateless" in name, f"Keras skipped a stateful case: {reason}"
        pytest.skip(f"Keras skips it on the TensorFlow backend: {reason}")
    problems = [text for _, text in result.errors + result.failures]
    if not problems:
        return
    report = "\n".join(problems)
    if name in BY_DESIGN and re.search(BY_DESIGN[name][1], report, re.S):
        raise ByDesign(f"{BY_DESIGN[name][0]}:\n{report}")
    pytest.fail(f"Keras' {name} fails against tfdls:\n{report}", pytrace=False)
