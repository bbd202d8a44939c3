"""A variant of a case, built and ready to time, and the check that it really ran.

`StepRun` calls a `tf.function` (the overhead and boundaries families),
`FitRun` calls `model.fit` (the fit family). timing.py calls `check` after the
warm-up and after timing: a variant that does not really train is never timed.
"""

import numpy as np
import tensorflow as tf

import optimizers


class Run:
    """One variant: `call(n)` runs n units of work and blocks until they ran.

    Args:
        name: the variant's name.
        variables: what its steps update; `check` reads the first and the last.
        optimizer: its optimizer, if any (recorded; a loss-scale one must skip no step).
    """

    def __init__(self, name, variables, optimizer=None):
        self.name, self.variables, self.optimizer = name, list(variables), optimizer
        self.skips_allowed = False  # fit.py: real training may overflow at the start
        self._before = self._snapshot()

    def call(self, n):
        raise NotImplementedError

    def traces(self):
        """How often the timed function was traced (None: not tracked)."""
        return None

    def record(self):
        """What the variant did, for the JSON."""
        return optimizers.record(self.optimizer) if self.optimizer is not None else {}

    def _snapshot(self):
        return [np.array(tf.convert_to_tensor(self.variables[i])) for i in (0, -1)
                if self.variables]

    def check(self, when):
        """Raises RuntimeError unless the calls since the last check changed the first and the
        last variable, kept them finite and (unless `skips_allowed`) skipped no step.

        Args:
            when: for the message, e.g. "during warm-up".
        """
        after = self._snapshot()
        for before, now in zip(self._before, after):
            if np.array_equal(before, now):
                raise RuntimeError(f"{self.name}: variables did not change {when}")
            if not np.all(np.isfinite(now.astype(np.float32))):
                raise RuntimeError(f"{self.name}: variables became non-finite {when}")
        self._before = after
        state = optimizers.scale_state(self.optimizer)
        if state and not self.skips_allowed and not state[0] >= state[1]:
            raise RuntimeError(f"{self.name}: a step was skipped {when} (scale {state[0]} "
                               f"below the initial {state[1]})")


class StepRun(Run):
    """Calls ``fn(*args)`` inside a `tf.function` (XLA in mode "xla").

    Args:
        name: the variant's name.
        fn: one step; with no `variables` it must return True (the check alone).
        args: its arguments, passed (never captured) so that XLA cannot fold them.
        mode: "graph" or "xla".
        variables: what the step updates.
        optimizer: see `Run`.
    """

    def __init__(self, name, fn, args, mode, variables, optimizer=None):
        super().__init__(name, variables, optimizer)
        self.step = tf.function(fn, jit_compile=mode == "xla", reduce_retracing=True)
        self.args = args

    def call(self, n):
        for _ in range(n):
            out = self.step(*self.args)
        if self.variables:  # one scalar read back waits for every queued step
            tf.reshape(tf.convert_to_tensor(self.variables[-1]), [-1])[0].numpy()
        elif not bool(out.numpy()):
            raise RuntimeError(f"{self.name}: finite gradients were reported non-finite")

    def traces(self):
        return self.step.experimental_get_tracing_count()


class FitRun(Run):
    """Calls ``model.fit`` for one epoch of `n` steps of `dataset` (a repeated one).

    Skipped steps are allowed (a mixed_float16 start can overflow), but not a
    call in which the optimizer applied none, nor a non-finite loss.
    """

    def __init__(self, name, model, dataset):
        super().__init__(name, model.trainable_variables, model.optimizer)
        self.model, self.dataset = model, dataset
        self.skips_allowed = True
        self.steps, self.loss, self._iterations = 0, None, 0

    def call(self, n):
        history = self.model.fit(self.dataset, epochs=1, steps_per_epoch=n, verbose=0,
                                 shuffle=False)
        self.loss = float(history.history["loss"][-1])  # a host value: the steps ran
        self.steps += n

    def check(self, when):
        super().check(when)
        iterations = int(self.model.optimizer.iterations.numpy())
        if not (np.isfinite(self.loss) and iterations > self._iterations):
            raise RuntimeError(f"{self.name}: loss {self.loss}, "
                               f"{iterations - self._iterations} steps applied {when}")
        self._iterations = iterations

    def record(self):
        return dict(super().record(), final_loss=self.loss, steps=self.steps,
                    jit_compile=self.model.jit_compile)  # "auto" resolved
