"""A recipe's ceiling from several seeds, and whether two recipes' ceilings differ.

One run's interval for A says how well that run's curve pins down that run's ceiling. Another
seed of the same config reaches a different ceiling (a different sample of prompts, rollouts
and updates), so a claim about the recipe needs the spread between seeds as well. Each seed's
fit is one estimate A_s = A + u_s + e_s: the recipe's ceiling, the seed's own offset u_s and the
run's fitting error e_s. The recipe's A is their mean, with the interval

    mean(A_s) +- t(S - 1) * sd(A_s) / sqrt(S)

The sample variance of the seeds' ceilings estimates both parts (between-seed and within-run)
at once, and the t quantile with S - 1 degrees of freedom is what few seeds cost: 12.7 for 2
seeds, 4.3 for 3, 2.8 for 5. benchmarks/bench_calibration.py --seeds 3 measures coverage.
(Flooring the variance at the runs' own interval widths, as a Hartung-Knapp adjustment does,
covered 100% there with intervals about twice as wide: it was dropped.)
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class RecipeCeiling:
    name: str
    a: float  # the mean of the seeds' own ceilings
    ci: tuple[float, float]  # at `level`, between-seed spread included; NaN for one seed
    seeds: int
    between_sd: float  # sample sd of the seeds' ceilings (NaN for one seed)
    se: float  # standard error of `a`
    level: float


def _z(level: float) -> float:
    from scipy import stats  # (half a second to import: here, not at start)

    return float(stats.norm.ppf((1 + level) / 2))


def recipe_ceiling(
    name: str, estimates, intervals, *, level: float = 0.95, a_max: float = 1.0
) -> RecipeCeiling:
    """The recipe's A from each seed's A (`estimates` [S]) and its interval at the same level
    (`intervals` [S, 2]); see the module docstring for the formula."""
    a = np.asarray(estimates, float)
    ci = np.asarray(intervals, float).reshape(-1, 2)
    if a.ndim != 1 or a.size == 0 or ci.shape[0] != a.size:
        raise ValueError(f"{name}: need one interval per seed, got {a.shape} and {ci.shape}")
    if not (np.isfinite(a).all() and np.isfinite(ci).all()):
        raise ValueError(f"{name}: a seed's ceiling or interval is not finite: {a}, {ci}")
    seeds = a.size
    if seeds < 2:  # nothing is known about how seeds differ; the run's own standard error
        se = float(ci[0, 1] - ci[0, 0]) / (2 * _z(level))
        return RecipeCeiling(name, float(a[0]), (math.nan, math.nan), 1, math.nan, se, level)
    between = float(np.var(a, ddof=1))
    se = math.sqrt(between / seeds)
    from scipy import stats  # (half a second to import: here, not at start)

    half = float(stats.t.ppf((1 + level) / 2, seeds - 1)) * se
    mean = float(a.mean())
    lo, hi = max(0.0, mean - half), min(a_max, mean + half)
    return RecipeCeiling(name, mean, (lo, hi), seeds, math.sqrt(between), se, level)


@dataclasses.dataclass(frozen=True)
class CeilingDifference:
    recipes: tuple[str, str]
    diff: float  # A[0] - A[1]
    ci: tuple[float, float]  # at `level`; NaN when either recipe has one seed
    level: float

    @property
    def verdict(self) -> str:
        """The recipe with the higher ceiling when the interval excludes 0, else
        "indistinguishable"."""
        lo, hi = self.ci
        if math.isnan(lo):
            return "unknown (needs 2 or more seeds per recipe)"
        if lo > 0:
            return self.recipes[0]
        if hi < 0:
            return self.recipes[1]
        return "indistinguishable"


def compare_ceilings(first: RecipeCeiling, second: RecipeCeiling) -> CeilingDifference:
    """Interval for first.a - second.a: Welch's t with Satterthwaite degrees of freedom."""
    diff = first.a - second.a
    if min(first.seeds, second.seeds) < 2:
        return CeilingDifference((first.name, second.name), diff, (math.nan, math.nan), first.level)
    v1, v2 = first.se**2, second.se**2
    if v1 + v2 == 0:  # every seed of both recipes reached the same ceiling
        return CeilingDifference((first.name, second.name), diff, (diff, diff), first.level)
    dof = (v1 + v2) ** 2 / (v1**2 / (first.seeds - 1) + v2**2 / (second.seeds - 1))
    from scipy import stats  # (half a second to import: here, not at start)

    half = float(stats.t.ppf((1 + first.level) / 2, dof)) * math.sqrt(v1 + v2)
    return CeilingDifference(
        (first.name, second.name), diff, (diff - half, diff + half), first.level
    )
