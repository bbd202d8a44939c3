"""A plain-Python model of DynamicLossScale's documented contract (the
pseudo-code in its class docstring), computed in np.float32 so that it matches
the implementation bit for bit. Shared by the contract and property tests."""

import numpy as np

F32 = np.float32


class ContractModel:
    def __init__(
        self,
        initial_loss_scale=2**15,
        increment_period=2000,
        multiplier=2.0,
        *,
        backoff_factor=None,
        min_loss_scale=1.0,
        max_loss_scale=None,
        hysteresis=1,
    ):
        self.s = F32(initial_loss_scale)
        self.period = increment_period
        self.m = F32(multiplier)
        self.bf = None if backoff_factor is None else F32(backoff_factor)
        self.min = F32(min_loss_scale)
        self.max = None if max_loss_scale is None else F32(max_loss_scale)
        self.hysteresis = hysteresis
        self.g = 0
        self.h = hysteresis
        self.skipped = 0
        self.since = 0

    def step(self, finite):
        with np.errstate(over="ignore", under="ignore"):
            if finite:
                self.g += 1
                if self.g >= self.period:
                    c = self.s * self.m
                    if self.max is not None:
                        c = np.minimum(c, self.max)
                    if np.isfinite(c):
                        self.s = c
                    self.g = 0
                    self.h = self.hysteresis
                self.since += 1
            else:
                self.g = 0
                self.h = max(self.h - 1, 0)
                if self.h == 0:
                    shrunk = self.s / self.m if self.bf is None else self.s * self.bf
                    self.s = np.maximum(shrunk, self.min)
                self.skipped += 1
                self.since = 0
        assert self.s.dtype == np.float32
        return finite

    def state(self):
        return (self.s.tobytes(), self.g, self.h, self.skipped, self.since)
