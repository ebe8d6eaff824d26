"""A run with no rise: the level its evals hold, and a forecast that it holds it.

A sigmoid describes a rise. A run that starts where it will stay (a distilled model already
at its level, a run whose RL does nothing) leaves the sigmoid without a point fit, and its
bootstrap without an interval; yet the data say something: the level, how well it is known,
and that the ceiling is at least that. The level model is

    y_t = mu + drift_t + noise_t,

the same noise as the sigmoid's bootstrap: the eval's sampling noise where it is known (the
eval set's size, or each eval's sd) plus an AR(1) drift of unknown size (`drift_model`), else
AR(1) noise of unknown size (`noise_model`). The posterior over the noise's grid weighs each
(rho, tau) by the residuals' restricted likelihood; given it, mu's posterior is the GLS mean
and its variance. Drawn together they give:

- the level's interval and its one-sided lower bound (mu >= lower at `level`): under the
  sigmoid, which never falls (R0 < A), the ceiling is at least the level a run holds, so
  this is A's one-sided bound where the sigmoid has no fit;
- the interval for a new eval: the level plus the drift and the eval's own sampling noise,
  which is what a forecast of an observed eval must cover.

The level is chosen by the data: only where the sigmoid has no point fit, and only where the
evals show no trend. The trend test is a GLS slope in log compute under the same noise
posterior (the p-value averaged over it; Student's t where the noise's size is read from the
residuals); a slope at p < TREND_ALPHA means the run is moving, and the level is not used
(`holds` False), with the slope in the reason. The test is weak on few evals (a rise of 0.05
over 6 evals of 200 problems goes unseen most of the time): a slow climb that the sigmoid
cannot describe either gets the level's forecast.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxrl_scale.fit.noise import drift_model, noise_model

TREND_ALPHA = 0.05  # a slope this significant says the run is not level


@dataclasses.dataclass(frozen=True)
class Level:
    """The level a run's evals hold (see the module docstring)."""

    mean: float  # mu's posterior mean
    interval: tuple[float, float]  # mu at `level`, two-sided
    lower: float  # mu >= lower at `level`, one-sided
    predict: tuple[float, float]  # a new eval at `level` (drift and sampling noise included)
    trend_p: float  # the p-value of a slope in log compute (small: the run moves)
    points: int
    level: float

    @property
    def holds(self) -> bool:
        """Whether the data give a level: no slope at p < TREND_ALPHA, and a lower bound above
        0 (evals too noisy to place one say nothing)."""
        return self.trend_p >= TREND_ALPHA and self.lower > 0

    @property
    def reason(self) -> str:
        lo, hi = self.interval
        if self.trend_p >= TREND_ALPHA and not self.holds:
            return (f"the evals are too noisy to place a level ({self.mean:.3f}, [{lo:.3f}, "
                    f"{hi:.3f}] at {self.level:.0%})")  # fmt: skip
        if not self.holds:
            return (f"the evals move (a slope in log compute at p = {self.trend_p:.2g}) without "
                    "the rise a sigmoid describes")  # fmt: skip
        return (f"the evals show no rise: they hold a level of {self.mean:.3f} ([{lo:.3f}, "
                f"{hi:.3f}] at {self.level:.0%}, {self.points} evals)")  # fmt: skip

    def to_dict(self) -> dict:
        return {
            "level": self.level,
            "mean": self.mean,
            "interval": list(self.interval),
            "lower": self.lower,
            "predict": list(self.predict),
            "trend_p": self.trend_p,
            "holds": self.holds,
            "points": self.points,
        }


def fit_level(compute, reward, *, eval_size: int | None = None, eval_sd=None,
              a_max: float = 1.0, level: float = 0.95, n: int = 4000,
              seed: int = 0) -> Level | None:  # fmt: skip
    """The level of evals `reward` [P] at `compute` [P] (run order; R0 may be the first, at
    compute 0). The known sampling noise: `eval_size` (binomial at the level) or `eval_sd`
    (each eval's sd [P]); neither: read from the residuals with the drift. None with too few
    evals to tell the noise (3 with it known, 4 without)."""
    y = np.asarray(reward, np.float64)
    p = y.size
    known = eval_size is not None or eval_sd is not None
    if p < (3 if known else 4):
        return None
    x = _log_compute(compute)
    ones, line = np.ones((p, 1)), np.column_stack([np.ones(p), x - x.mean()])
    off_line = y - np.polyval(np.polyfit(x, y, 1), x)
    rng = np.random.default_rng(seed)
    if known:
        if eval_size is not None:
            rate = min(max(float(y.mean()), 0.5 / eval_size), 1 - 0.5 / eval_size)
            v = np.full(p, rate * (1 - rate) / eval_size)
        else:
            v = np.maximum(np.asarray(eval_sd, np.float64), 1e-6) ** 2
        model, trend = drift_model(y - y.mean(), ones, v), drift_model(off_line, line, v)
        model, trend = _nonnegative(model), _nonnegative(trend)
        covs, trend_covs = (
            _covariances(v, model.rho, model.tau),
            _covariances(v, trend.rho, trend.tau),
        )
    else:
        model, trend = noise_model(y - y.mean(), ones), noise_model(off_line, line)
        model, trend = _nonnegative(model), _nonnegative(trend)
        covs = _covariances(np.zeros(p), model.rho, np.ones_like(model.rho))
        trend_covs = _covariances(np.zeros(p), trend.rho, np.sqrt(trend.scale))
    beta, cov = _gls(covs, ones, y)
    mu_hat, mu_var = beta[:, 0], cov[:, 0, 0]  # (without known noise: in units of sigma^2)
    slope, slope_cov = _gls(trend_covs, line, y)
    z = np.abs(slope[:, 1]) / np.sqrt(np.maximum(slope_cov[:, 1, 1], 1e-300))
    if known:  # a normal reference: the noise's size is known given the cell
        tails = np.array([math.erfc(v / math.sqrt(2)) for v in z])
    else:  # read from p - 2 residuals: Student's t
        from scipy.stats import t as t_dist  # (scipy.stats: half a second to import)

        tails = 2 * t_dist.sf(z, trend.dof)
    trend_p = float(np.sum(trend.weight * tails))
    if np.ptp(y) < 1e-9:  # every eval the same: no slope (z of rounding noise otherwise)
        trend_p = 1.0
    # Draws: a cell of the noise grid by its weight, mu given it, a new eval given mu.
    g = rng.choice(model.weight.size, size=n, p=model.weight)
    if known:
        mu = mu_hat[g] + rng.standard_normal(n) * np.sqrt(mu_var[g])
        if eval_size is not None:
            rate = np.clip(mu, 0.5 / eval_size, 1 - 0.5 / eval_size)
            sampling = rate * (1 - rate) / eval_size
        else:  # the last eval's sd, as the sigmoid's forecasts assume
            sampling = v[-1]
        new_var = model.tau[g] ** 2 + sampling
    else:
        new_var = model.scale[g] * model.dof / rng.chisquare(model.dof, n)
        mu = mu_hat[g] + rng.standard_normal(n) * np.sqrt(mu_var[g] * new_var)
    new = np.clip(mu + rng.standard_normal(n) * np.sqrt(new_var), 0.0, a_max)
    tail = (1 - level) / 2
    mu = np.clip(mu, 0.0, a_max)  # (a rate: evals at 0 or 1 put mu's draws over the edge)
    lo, hi = np.quantile(mu, [tail, 1 - tail])
    plo, phi = np.quantile(new, [tail, 1 - tail])
    return Level(
        mean=float(np.mean(mu)),
        interval=(float(lo), float(hi)),
        lower=float(np.quantile(mu, 1 - level)),
        predict=(float(plo), float(phi)),
        trend_p=trend_p,
        points=p,
        level=level,
    )


def _nonnegative(model):
    """Evals drift together or not at all: a negative correlation (alternating errors, which
    would make a mean look precise) is not a noise a run's evals have. The posterior on its
    rho >= 0 cells only (a NoiseModel's or DriftModel's grid arrays
    cut to them, the weight renormalised)."""
    keep = model.rho >= 0
    grid = [n for n in ("rho", "tau", "scale", "weight") if hasattr(model, n)]
    cut = {n: getattr(model, n)[keep] for n in grid}
    cut["weight"] = cut["weight"] / cut["weight"].sum()
    return dataclasses.replace(model, **cut)


def _log_compute(compute) -> np.ndarray:
    """log compute, with an eval at compute 0 (R0) placed one mean spacing before the first
    eval with compute (a slope is read in log compute, where a sigmoid rises)."""
    c = np.asarray(compute, np.float64)
    pos = c > 0
    x = np.zeros(c.size)
    if not pos.any():
        return np.arange(c.size, dtype=np.float64)
    x[pos] = np.log(c[pos])
    steps = np.diff(np.sort(x[pos]))
    x[~pos] = x[pos].min() - (steps.mean() if steps.size else 1.0)
    return x


def _covariances(v, rho, tau) -> np.ndarray:
    """[G, P, P]: diag(v) + tau^2 R(rho) for each grid cell."""
    p = v.size
    lag = np.abs(np.arange(p)[:, None] - np.arange(p)[None, :])
    return np.diag(v)[None] + (tau**2)[:, None, None] * rho[:, None, None] ** lag[None]


def _gls(covs, x, y):
    """GLS coefficients [G, K] and their covariances [G, K, K] under each covariance."""
    chol = np.linalg.cholesky(covs)
    g = covs.shape[0]
    wx = np.linalg.solve(chol, np.broadcast_to(x, (g, *x.shape)))
    wy = np.linalg.solve(chol, np.broadcast_to(y[:, None], (g, y.size, 1)))[..., 0]
    xtx = np.einsum("gpk,gpl->gkl", wx, wx)
    cov = np.linalg.inv(xtx)
    beta = np.einsum("gkl,gl->gk", cov, np.einsum("gpk,gp->gk", wx, wy))
    return beta, cov
