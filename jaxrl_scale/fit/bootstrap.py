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
Method = Literal["pairs", "residual", "block"]


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
            noise = jax.random.normal(jax.random.key(seed), preds.shape) * self.fit.rmse
            preds = preds + noise
        tail = (1 - self.level) / 2
        lo, hi = jnp.quantile(preds, jnp.array([tail, 1 - tail]), axis=0)
        return lo, self.fit.predict(c), hi


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
    method: Method = "pairs",
    block: int | None = None,
    a_max: float = 1.0,
    c_min: float | None = None,
    n_iter: int = 20,
    pad_to: int | None = None,
) -> BootstrapResult:
    """Percentile bootstrap intervals for A, B, C_mid, r0 and predictions.

    Methods: "pairs" resamples points with replacement; "block" resamples runs of `block`
    consecutive points (default about P ** (1/3)), for evaluation points that are correlated
    along one run; "residual" keeps the points and adds resampled residuals of the point fit.
    All n refits run in one jitted, vmapped call. `pad_to` pads the curve with weight-0 points
    to that many, so a growing curve (an online forecast) reuses one compiled program.
    """
    if method not in ("pairs", "residual", "block"):
        raise ValueError(f"method must be 'pairs', 'residual' or 'block', got {method!r}")
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
    ys, ws = _resample(jax.random.key(seed), y, fitted, p, n=n, method=method, block=block)
    fits = fit_batch(log_c, ys, ws, held_r0, jnp.zeros((n,), float), spec=spec)
    samples = {k: getattr(fits, k) for k in PARAMS}
    keep = np.asarray(fits.converged)
    tail = (1 - level) / 2
    ci = {}
    for k, v in samples.items():
        kept = np.asarray(v)[keep]
        ci[k] = (
            tuple(float(q) for q in np.quantile(kept, [tail, 1 - tail]))
            if kept.size
            else (math.nan, math.nan)
        )
    c_max = float(curve.compute[-1])
    return BootstrapResult(point, samples, fits.converged, ci, level, method, c_max)
