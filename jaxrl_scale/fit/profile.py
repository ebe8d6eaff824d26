"""Whether the data pin the ceiling A down, decided from the likelihood: A's profile.

For each A on a grid the curve is refitted with A held (B, C_mid and a free R0 refitted), all
in one batched call; SSE(A) is its least sum of squares. With the evaluation noise's variance
per point s2, inflated for its correlation along the run (`inflated_variance`: an AR(1)
part's variance times (1 + rho) / (1 - rho), the variance inflation of a mean of AR(1) noise:
correlated evals carry less information than as many independent ones), the deviance

    D(A) = (SSE(A) - SSE_min) / s2

is about chi-square with one degree of freedom at the true A. The verdict comes from where D
crosses the threshold:

- "identified": D exceeds chi2_1(level) both below and above the fitted A: the interval
  {A : D <= chi2_1(level)} is closed and inside the bounds (R0, a_max).
- "lower bound": D exceeds the one-sided threshold (chi2_1(2 level - 1), 2.71 at 95%) below the
  fit but nowhere up to a_max: the data rule out a lower ceiling, not a higher one, and
  `lower` is the one-sided bound (A >= lower at `level`). A run still climbing.
- "not identified": D stays below the threshold on both sides (evals that do not rise, or
  too few of them), or the fit failed.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jaxrl_scale.fit.sigmoid_fit import FitResult, FitSpec, fit_batch

IDENTIFIED, LOWER, NOT_IDENTIFIED = "identified", "lower bound", "not identified"
GRID = 96  # held values of A between the lowest plausible ceiling and a_max
RHO_MAX = 0.9  # correlation beyond which the inflation (1 + rho) / (1 - rho) is capped


@dataclasses.dataclass(frozen=True)
class Profile:
    """A's profile likelihood and the verdict it gives (see the module docstring)."""

    verdict: str  # IDENTIFIED | LOWER | NOT_IDENTIFIED
    lower: float | None  # A >= lower (one-sided, at `level`), when the data rule out less
    interval: tuple[float, float] | None  # the two-sided profile interval, when identified
    a: np.ndarray  # [G] held values of A
    deviance: np.ndarray  # [G] D(A)
    level: float
    reason: str  # the verdict in the data's terms


def inflated_variance(independent: float, correlated: float, rho: float) -> float:
    """The noise variance per point a profile divides by: an independent part (the eval's
    sampling) plus an AR(1) part times (1 + rho) / (1 - rho) (rho capped at RHO_MAX; a
    negative rho counts as 0)."""
    rho = min(max(float(rho), 0.0), RHO_MAX)
    return float(independent) + float(correlated) * (1 + rho) / (1 - rho)


def profile_a(log_c, y, w, point: FitResult, spec: FitSpec, *, noise_var: float,
              level: float = 0.95, held_r0: float = 0.0,
              dof: int | None = None) -> Profile:  # fmt: skip
    """A's profile for one curve: ln C, rewards and weights [P] (weight 0: padding), the point
    fit, the fit's spec (`fit_r0`, `a_max`, `b_min`), the noise variance per point
    (`inflated_variance`), a held R0's value. `dof`: the residual degrees of freedom when
    `noise_var` was estimated from the same residuals, whose thresholds are then F(1, dof)
    quantiles (chi-square(1) ones for a known noise)."""
    if not 0.5 < level < 1:
        raise ValueError(f"level must be in (0.5, 1) for a profile, got {level}")
    a_max = spec.a_max
    present = np.asarray(w) > 0
    ys = np.asarray(y)[present]
    if not bool(point.converged) or not math.isfinite(noise_var) or noise_var <= 0:
        why = "the fit did not converge" if not bool(point.converged) else "no noise estimate"
        return _verdict(NOT_IDENTIFIED, None, None, np.zeros(0), np.zeros(0), level, why)
    # The grid reaches below the lowest eval by six noise sds: where every eval sits near
    # the ceiling (a run that rose before its first eval), ceilings under the evals are what
    # the data rule out. A held R0 is a floor (R0 < A); a fitted one moves below a held A.
    lowest = float(ys.min()) - 6 * math.sqrt(noise_var)
    if not spec.fit_r0:
        lowest = max(lowest, float(held_r0))
    lowest = max(lowest, 0.0) + 1e-4
    if lowest >= a_max - 2e-4:
        why = f"the evals sit at a_max = {a_max:g}: there is no ceiling below it to rule out"
        return _verdict(NOT_IDENTIFIED, None, None, np.zeros(0), np.zeros(0), level, why)
    grid = np.unique(np.concatenate([np.linspace(lowest, a_max - 1e-4, GRID), [float(point.a)]]))
    g = grid.size
    held = FitSpec(a_max=a_max, fit_r0=spec.fit_r0, fit_a=False, n_iter=spec.n_iter,
                   b_min=spec.b_min, settle=spec.settle)  # fmt: skip
    y_g = jnp.broadcast_to(jnp.asarray(y), (g, np.size(y)))
    w_g = jnp.broadcast_to(jnp.asarray(w), (g, np.size(w)))
    fits = fit_batch(jnp.asarray(log_c), y_g, w_g, jnp.full((g,), held_r0),
                     jnp.asarray(grid, y_g.dtype), spec=held)  # fmt: skip
    total_w = float(np.sum(np.asarray(w)))
    sse = np.asarray(fits.rmse, np.float64) ** 2 * total_w
    # A held fit that failed is no evidence: its D is unknown (NaN), never "ruled out".
    sse = np.where(np.isfinite(sse) & np.asarray(fits.converged), sse, np.nan)
    sse_min = np.nanmin(np.append(sse, float(point.rmse) ** 2 * total_w))
    deviance = (sse - sse_min) / noise_var
    if not np.any(np.isfinite(deviance)):
        why = "no fit with A held converged"
        return _verdict(NOT_IDENTIFIED, None, None, grid, deviance, level, why)
    best = float(grid[int(np.nanargmin(deviance))])
    from scipy.stats import chi2  # (scipy.stats: half a second to import; here, not at start)
    from scipy.stats import f as f_dist

    if dof is None:
        two, one = float(chi2.ppf(level, 1)), float(chi2.ppf(2 * level - 1, 1))
    else:
        two = float(f_dist.ppf(level, 1, max(dof, 1)))
        one = float(f_dist.ppf(2 * level - 1, 1, max(dof, 1)))
    below, above = grid < best, grid > best
    beyond = lambda side, t: bool(np.any(deviance[side] > t))  # noqa: E731 (NaN: False)
    ruled_out_below = beyond(below, one)
    closed = beyond(below, two) and beyond(above, two)
    pct = f"{level:.0%}"
    if closed:
        lo = _crossing(grid, deviance, two, best, side=-1)
        hi = _crossing(grid, deviance, two, best, side=+1)
        why = (f"the data rule out a ceiling below {lo:.3g} and above {hi:.3g} at {pct} "
               "(profile likelihood)")  # fmt: skip
        return _verdict(IDENTIFIED, lo, (lo, hi), grid, deviance, level, why)
    if ruled_out_below:
        lo = _crossing(grid, deviance, one, best, side=-1)
        if not beyond(above, one):
            why = (f"A >= {lo:.3g} at {pct}: the data rule out a lower ceiling, not a higher "
                   f"one (a ceiling up to a_max = {a_max:g} fits them as well: the run is "
                   "still climbing)")  # fmt: skip
        else:
            why = (f"A >= {lo:.3g} at {pct}: the data rule out a lower ceiling; higher ones "
                   "fit them less well, but not so much less that they are ruled out")  # fmt: skip
        return _verdict(LOWER, lo, None, grid, deviance, level, why)
    if beyond(above, two):
        hi = _crossing(grid, deviance, two, best, side=+1)
        why = (f"the data rule out a ceiling above {hi:.3g} at {pct}, but none below it down "
               "to where the evals are: they do not show where the rise ends")  # fmt: skip
        return _verdict(NOT_IDENTIFIED, None, None, grid, deviance, level, why)
    why = (f"every ceiling from {grid[0]:.3g} to a_max = {a_max:g} fits the evals about as "
           "well: they do not rise clearly enough above their noise")  # fmt: skip
    return _verdict(NOT_IDENTIFIED, None, None, grid, deviance, level, why)


def _verdict(verdict, lower, interval, grid, deviance, level, reason) -> Profile:
    return Profile(verdict, None if lower is None else float(lower),
                   None if interval is None else tuple(map(float, interval)),
                   grid, deviance, level, reason)  # fmt: skip


def _crossing(grid, deviance, threshold: float, best: float, *, side: int) -> float:
    """Where D rises through `threshold` going from the best A to one side (linear between
    grid points): the profile interval's end on that side."""
    order = np.nonzero(grid > best)[0] if side > 0 else np.nonzero(grid < best)[0][::-1]
    prev_a, prev_d = best, 0.0
    for i in order:
        a, d = float(grid[i]), float(deviance[i])
        if not math.isfinite(d):  # a held fit that failed: skipped
            continue
        if d > threshold:
            t = (threshold - prev_d) / max(d - prev_d, 1e-12)
            return prev_a + t * (a - prev_a)
        prev_a, prev_d = a, d
    return float(grid[order[-1]]) if order.size else best
