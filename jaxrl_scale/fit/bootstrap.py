"""Bootstrap intervals for the sigmoid fit: thousands of refits in one compiled call.

Shapes: n resamples, P points.

Resampling never changes shapes: a pairs or block resample is a vector of counts (how often each
point was drawn) used as least-squares weights, and a residual resample keeps the points and
swaps the rewards. The compute axis is shared by every resample, which the fitter exploits.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_scale.fit.curves import sigmoid
from jaxrl_scale.fit.data import clean_curve
from jaxrl_scale.fit.sigmoid_fit import FitResult, FitSpec, fit_batch, pad_curves

PARAMS = ("a", "b", "c_mid", "r0")
Method = Literal["auto", "pairs", "residual", "block"]
METHODS = ("auto", "pairs", "residual", "block")
MAX_AUTOCORRELATION = 0.95  # cap on the estimate (the widening factor is then at most 6.2)


def lag1_autocorrelation(residuals, fitted_params: int = 0) -> float:
    """Lag-1 autocorrelation of a fit's residuals in run order, bias-corrected.

    rho = sum(e_t e_{t-1}) / sum(e_t^2) of the centred residuals, plus (1 + 3 rho) / n (the
    first-order bias for an AR(1) series with an estimated mean; Marriott and Pope 1954) and
    `fitted_params` / n (a smooth fit absorbs the slow part of correlated noise, so residuals
    look less correlated than the noise is). Without the corrections correlated noise reads
    as weaker than it is. Capped at 0.95.
    """
    e = np.asarray(residuals, float)
    n = e.size
    if n < 3:
        return 0.0
    e = e - e.mean()
    energy = float(np.sum(e * e))
    if energy <= 0:
        return 0.0
    rho = float(np.sum(e[1:] * e[:-1])) / energy
    rho += (1 + 3 * rho + fitted_params) / n
    return float(np.clip(rho, -0.99, MAX_AUTOCORRELATION))


def widening(rho: float) -> float:
    """How much wider an interval must be when the noise is AR(1) with coefficient rho than
    when it is independent: sqrt((1 + rho) / (1 - rho)), the square root of the ratio of
    points to effectively independent points. 1 when rho <= 0 (never narrower)."""
    return float(np.sqrt((1 + rho) / (1 - rho))) if rho > 0 else 1.0


@dataclasses.dataclass(frozen=True)
class BootstrapResult:
    """Point fit, resampled fits, and percentile intervals at `level`."""

    fit: FitResult  # the fit to the data as given
    samples: dict[str, jax.Array]  # name -> [n], every resample (see `converged`)
    converged: jax.Array  # [n] bool; intervals use converged resamples only
    ci: dict[str, tuple[float, float]]  # name -> (lo, hi)
    level: float
    method: str
    c_max: float  # the largest compute in the data
    # "auto": the residuals' bias-corrected lag-1 autocorrelation and the factor intervals are
    # widened by around the point estimate (1: independent noise, plain pairs intervals).
    autocorrelation: float = 0.0
    inflation: float = 1.0
    noise_sd: float = 0.0  # evaluation noise for forecasts: rmse with a degrees-of-freedom fix
    a_max: float = 1.0

    @property
    def converged_fraction(self) -> float:
        return float(jnp.mean(self.converged))

    @property
    def identifiable(self) -> bool:
        """The data pin the curve down: the point fit is identifiable, at least 90% of the
        resamples converge, and even the upper end of the C_mid interval lies inside the data
        (the inflection is observed in the resamples too, not only in the point fit)."""
        return (
            bool(self.fit.identifiable)
            and self.converged_fraction >= 0.9
            and self.ci["c_mid"][1] <= self.c_max
        )

    def to_dict(self) -> dict:
        """The one serialisation of a fit (fit.json, `jaxrl-scale fit --json`, the sweep):
        each parameter with its interval, R0, rmse and the flags that qualify them."""
        fit = self.fit
        out: dict = {}
        for name in ("a", "b", "c_mid"):
            out[name] = float(getattr(fit, name))
            out[f"{name}_ci"] = [float(v) for v in self.ci[name]]
        out.update(
            r0=float(fit.r0),
            rmse=float(fit.rmse),
            converged=bool(fit.converged),
            identifiable=self.identifiable,
            bootstrap_converged=self.converged_fraction,
            level=self.level,
            method=self.method,
            autocorrelation=self.autocorrelation,
            inflation=self.inflation,
        )
        return out

    def predict_ci(self, c, *, observation_noise: bool = False, seed: int = 0):
        """(lo, mid, hi) predicted reward at compute `c`, each shaped like `c`: percentiles over
        converged resamples, around the point fit's prediction.

        With `observation_noise`, the interval is for a new *measurement* at `c` (the curve's
        uncertainty plus evaluation noise with the point fit's residual spread), which is what
        a forecast of an observed eval point must cover.
        """
        c = jnp.asarray(c, float)
        keep = np.asarray(self.converged)
        if not keep.any():  # no resample converged: there is no interval to give
            nan = jnp.full(c.shape, jnp.nan)
            return nan, self.fit.predict(c), nan
        params = [np.asarray(self.samples[k])[keep].reshape((-1,) + (1,) * c.ndim) for k in PARAMS]
        preds = sigmoid(c, *params)
        if observation_noise:
            noise = jax.random.normal(jax.random.key(seed), preds.shape) * self.noise_sd
            preds = preds + noise
        mid = self.fit.predict(c)
        preds = jnp.clip(mid + self.inflation * (preds - mid), 0.0, self.a_max)
        tail = (1 - self.level) / 2
        lo, hi = jnp.quantile(preds, jnp.array([tail, 1 - tail]), axis=0)
        return lo, mid, hi


def _counts(idx, p: int):
    """[n, P] draw counts from [n, k] drawn indices (an index of p or more is not counted)."""
    return jax.vmap(lambda i: jnp.bincount(i, length=p))(idx).astype(float)


@functools.partial(jax.jit, static_argnames=("n", "method", "block"))
def _resample(key, y, fitted, p, *, n: int, method: str, block: int):
    """Rewards [n, W] and weights [n, W] for n resamples of the first `p` of W points (the
    rest is padding and keeps weight 0; `p` is traced, so curves of any length up to W share
    one compiled program)."""
    width = y.shape[0]
    present = jnp.arange(width) < p
    if method == "pairs":
        idx = jax.random.randint(key, (n, width), 0, p)
        return jnp.broadcast_to(y, (n, width)), _counts(jnp.where(present, idx, width), width)
    if method == "block":  # moving blocks of consecutive (correlated) points
        n_blocks = -(-width // block)
        starts = jax.random.randint(key, (n, n_blocks), 0, p - block + 1)
        idx = (starts[:, :, None] + jnp.arange(block)).reshape(n, -1)[:, :width]
        return jnp.broadcast_to(y, (n, width)), _counts(jnp.where(present, idx, width), width)
    residual = jnp.where(present, y - fitted, 0.0)  # residual bootstrap: refit the curve plus
    residual = jnp.where(present, residual - jnp.sum(residual) / p, 0.0)  # reshuffled residuals
    draws = residual[jax.random.randint(key, (n, width), 0, p)]
    return fitted + draws, jnp.broadcast_to(present.astype(float), (n, width))


def resample(curve, fitted, *, n: int, seed: int, method: Method = "pairs", block=None):
    """(rewards [n, P], weights [n, P]) of n resamples of a clean curve (fit.data.Curve) whose
    point fit predicts `fitted` [P] (used by the residual method)."""
    p = curve.compute.size
    block = block or max(2, round(p ** (1 / 3)))
    y = jnp.asarray(curve.reward, float)
    return _resample(jax.random.key(seed), y, jnp.asarray(fitted, float), p, n=n,
                     method=method, block=block)  # fmt: skip


def bootstrap_sigmoid(
    compute,
    reward,
    n: int = 10_000,
    seed: int = 0,
    r0=None,
    level: float = 0.95,
    *,
    method: Method = "auto",
    block: int | None = None,
    a_max: float = 1.0,
    c_min: float | None = None,
    n_iter: int = 20,
    pad_to: int | None = None,
) -> BootstrapResult:
    """Percentile bootstrap intervals for A, B, C_mid, r0 and predictions.

    Methods: "pairs" resamples points with replacement; "block" resamples runs of `block`
    consecutive points (default about P ** (1/3)); "residual" keeps the points and adds
    resampled residuals of the point fit. "auto" (the default) is "pairs" adapted to the
    data: it estimates how correlated the residuals are along the run
    (`lag1_autocorrelation`) and, when they are positively correlated (successive evals
    drifting together), widens every interval around the point estimate by `widening(rho)`
    (in log space for B and C_mid); with independent or anti-correlated residuals it is plain
    "pairs". benchmarks/bench_calibration.py measures each method's coverage.
    All n refits run in one jitted, vmapped call. `pad_to` pads the curve with weight-0 points
    to that many, so a growing curve (an online forecast) reuses one compiled program.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    curve = clean_curve(compute, reward, a_max=a_max, c_min=c_min)
    p = curve.compute.size
    block = block or max(2, round(p ** (1 / 3)))
    if method == "block" and not 1 <= block <= p:
        raise ValueError(f"block must be in [1, {p}], got {block}")
    width = max(p, pad_to or 0)
    log_c, y, w = (jnp.asarray(v[0]) for v in pad_curves([curve], width))
    held_r0 = jnp.broadcast_to(jnp.asarray(0.0 if r0 is None else r0, float), (n,))
    spec = FitSpec(a_max=float(a_max), fit_r0=r0 is None, n_iter=n_iter)
    point = jax.tree.map(
        lambda v: v[0], fit_batch(log_c, y[None], w[None], held_r0[:1], jnp.zeros((1,)), spec=spec)
    )
    fitted = jnp.where(w > 0, point.predict(jnp.exp(log_c)), 0.0)
    draw = "pairs" if method == "auto" else method
    ys, ws = _resample(jax.random.key(seed), y, fitted, p, n=n, method=draw, block=block)
    fits = fit_batch(log_c, ys, ws, held_r0, jnp.zeros((n,), float), spec=spec)
    samples = {k: getattr(fits, k) for k in PARAMS}
    free = 3 + int(spec.fit_r0)  # A, B, C_mid (+ R0)
    residuals = np.asarray(y - fitted)[:p]
    rho = lag1_autocorrelation(residuals, free) if method == "auto" else 0.0
    factor = widening(rho)
    noise_sd = float(point.rmse) * math.sqrt(p / max(p - free, 1))
    keep = np.asarray(fits.converged)
    tail = (1 - level) / 2
    ci = {}
    for k, v in samples.items():
        kept = np.asarray(v)[keep]
        if not kept.size:
            ci[k] = (math.nan, math.nan)
            continue
        lo, hi = np.quantile(kept, [tail, 1 - tail])
        ci[k] = _widened(k, float(getattr(point, k)), float(lo), float(hi), factor, a_max)
    c_max = float(curve.compute[-1])
    return BootstrapResult(
        point, samples, fits.converged, ci, level, method, c_max, rho, factor, noise_sd, a_max
    )


def _widened(name: str, mid: float, lo: float, hi: float, factor: float, a_max: float):
    """A percentile interval stretched by `factor` around the point estimate: in log space
    for the positive B and C_mid, clipped to [0, a_max] for A and R0."""
    if factor == 1.0:
        return lo, hi
    if name in ("b", "c_mid"):
        log_mid = math.log(mid)
        stretch = lambda v: math.exp(log_mid + factor * (math.log(v) - log_mid))  # noqa: E731
        new_lo, new_hi = stretch(lo), stretch(hi)
    else:
        new_lo, new_hi = max(0.0, mid - factor * (mid - lo)), min(a_max, mid + factor * (hi - mid))
    return min(lo, new_lo), max(hi, new_hi)  # never narrower (a point outside its interval)
