"""Closed loop on the latency model: a robust multiplicative correction from measured step times.

A profile is measured under one load (other processes, thermal state, a different prompt mix);
serving runs under another. We compare each step's measured forward + verify time with what the
model predicted for that exact step shape and keep an EMA of the log ratio. Working in log space
makes 2x too slow and 2x too fast symmetric; clipping each sample's innovation keeps one outlier
(a GC pause, a page fault storm) from yanking the correction; clipping the total keeps a broken
measurement from switching the planner's notion of cost off entirely.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..profiler.latency_model import LatencyModel, StepShape


@dataclass(frozen=True)
class DriftConfig:
    smoothing: float = 0.1  # EMA weight of a new sample once warm (~10 steps of memory)
    max_innovation: float = 0.25  # largest move of the log factor from one sample (~1.28x)
    max_log_factor: float = math.log(4.0)  # the correction stays within 1/4x .. 4x
    min_seconds: float = 1e-6  # steps faster than this carry no timing information

    def __post_init__(self) -> None:
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")
        if self.max_innovation <= 0 or self.max_log_factor <= 0:
            raise ValueError("max_innovation and max_log_factor must be > 0")


class DriftCorrection:
    """measured / predicted, smoothed in log space; ``factor`` multiplies the model's predictions."""

    def __init__(self, config: DriftConfig = DriftConfig()):
        self.config = config
        self.log_factor = 0.0
        self.factor = 1.0  # kept as a plain attribute: read on every prediction
        self.samples = 0

    def update(self, predicted_s: float, measured_s: float) -> None:
        cfg = self.config
        if not (predicted_s > cfg.min_seconds and measured_s > cfg.min_seconds):
            return  # also rejects NaN
        # A running mean for the first samples (fast warm-up), then an EMA.
        weight = max(cfg.smoothing, 1.0 / (self.samples + 1))
        innovation = math.log(measured_s / predicted_s) - self.log_factor
        innovation = max(-cfg.max_innovation, min(cfg.max_innovation, innovation))
        self.log_factor = max(-cfg.max_log_factor,
                              min(cfg.max_log_factor, self.log_factor + weight * innovation))
        self.factor = math.exp(self.log_factor)
        self.samples += 1


class DriftCorrectedLatency:
    """A LatencyModel whose predictions are scaled by the current drift factor."""

    def __init__(self, inner: LatencyModel, drift: DriftCorrection):
        self.inner = inner
        self.drift = drift

    def predict(self, shape: StepShape) -> float:
        return self.inner.predict(shape) * self.drift.factor

    def observe(self, shape: StepShape, measured_s: float) -> None:
        """Fold in one measured step (forward + verify seconds) of the given shape."""
        self.drift.update(self.inner.predict(shape), measured_s)
