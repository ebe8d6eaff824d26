"""The online forecast a run makes of its own curve (`forecast.*`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl_scale.configbase import require


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForecastConfig:
    """The online forecast: refit the sigmoid to the eval curve while training (forecast.py)."""

    every: int = 1  # refit after every M-th held-out evaluation; 0 = off
    x: Literal["compute_flops", "device_seconds"] = "compute_flops"
    budget: float = 0.0  # compute to predict the pass rate at; 0 = the run's projected end
    bootstrap: int = 1000  # resamples for the intervals
    level: float = 0.95
    method: Literal["auto", "pairs", "block", "residual"] = "auto"  # fit.bootstrap_sigmoid
    min_points: int = 4  # evaluations after step 0 before the first fit
    # Leave out evals below this fraction of the latest eval's compute (early transients, as
    # the paper drops its first ~1.5k of 50k GPU-hours); never leaves fewer than min_points.
    # 0.05 is measured (docs/benchmarks.md, "early cut-off"): on curves with an early
    # transient it narrowed A's interval by a fifth and raised identifiable fits from 90% to
    # 97% at the same coverage; on clean curves it costs about 5% width; 0.2 cost 50%.
    c_min_fraction: float = 0.05
    # Stop the run once the upper bound of the gain still to come (ceiling A minus the fitted
    # pass rate now) is below this; 0 = never stop early.
    stop_when_gain_below: float = 0.0
    # Stop (with a checkpoint) once the evals have fallen after a peak by more than their noise
    # allows (fit.decline).
    stop_when_declining: bool = False

    def __post_init__(self):
        require(self.every >= 0, "forecast.every", "must be >= 0")
        require(self.budget >= 0, "forecast.budget", "must be >= 0")
        require(self.bootstrap >= 10, "forecast.bootstrap", "must be >= 10")
        require(0 < self.level < 1, "forecast.level", f"must be in (0, 1), got {self.level}")
        require(self.min_points >= 4, "forecast.min_points", "must be >= 4 (the curve has 4)")
        require(0 <= self.c_min_fraction < 1, "forecast.c_min_fraction", "must be in [0, 1)")
        require(self.stop_when_gain_below >= 0, "forecast.stop_when_gain_below", "must be >= 0")
