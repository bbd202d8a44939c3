"""Every `>>>` example in tfdls' docstrings runs and prints what it shows.

They run eagerly, each module in a fresh namespace holding `tfdls`, `tf`,
`keras` and `np` (the fixture namespace the examples assume).
"""

import doctest
import importlib
import pkgutil
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdls

# Every module, those of subpackages (tfdls.boundaries.*) included.
MODULES = sorted(
    name for _, name, _ in pkgutil.walk_packages(tfdls.__path__, prefix="tfdls.")
)


def _examples(module_name):
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    return [t for t in finder.find(module, module_name) if t.examples]


def test_every_public_name_has_an_example():
    documented = {t.name.rsplit(".", 1)[-1] for m in MODULES for t in _examples(m)}
    missing = sorted(set(tfdls.__all__) - documented)
    assert not missing, missing


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples_run(module_name):
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    )
    for test in _examples(module_name):
        test.globs = {"tfdls": tfdls, "tf": tf, "keras": keras, "np": np, "warnings": warnings}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. the stuck-scale warning an example triggers
            runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"


def test_help_lists_the_optimizers_attributes_and_properties():
    import pydoc

    text = pydoc.render_doc(tfdls.LossScaleOptimizer, renderer=pydoc.plaintext)
    for attribute in ("inner_optimizer:", "loss_scale:", "step_plan:"):
        assert attribute in text, attribute
    for name in ("dynamic", "initial_scale", "dynamic_growth_steps", "dynamic_scale",
                 "step_counter"):
        assert getattr(tfdls.LossScaleOptimizer, name).__doc__, name
