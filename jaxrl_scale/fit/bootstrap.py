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
from jaxrl_scale.fit.sigmoid_fit import FitResult, FitSpec, fit_batch, fit_sigmoid

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

    def predict_ci(self, c, *, observation_noise: bool = False, seed: int = 0):
        """(lo, mid, hi) predicted reward at compute `c`, each shaped like `c`: percentiles over
        converged resamples, around the point fit's prediction.

        With `observation_noise`, the interval is for a new *measurement* at `c` (the curve's
        uncertainty plus evaluation noise with the point fit's residual spread), which is what
        a forecast of an observed eval point must cover.
        """
        c = jnp.asarray(c, float)
        keep = np.asarray(self.converged)
        params = [np.asarray(self.samples[k])[keep].reshape((-1,) + (1,) * c.ndim) for k in PARAMS]
        preds = sigmoid(c, *params)
        if observation_noise:
            noise = jax.random.normal(jax.random.key(seed), preds.shape) * self.fit.rmse
            preds = preds + noise
        tail = (1 - self.level) / 2
        lo, hi = jnp.quantile(preds, jnp.array([tail, 1 - tail]), axis=0)
        return lo, self.fit.predict(c), hi


def _counts(idx_np, p: int):
    """[n, P] draw counts from [n, k] drawn indices."""
    return jax.vmap(lambda i: jnp.bincount(i, length=p))(idx_np).astype(float)


@functools.partial(jax.jit, static_argnames=("n", "method", "block"))
def _resample(key, y, fitted, *, n: int, method: str, block: int):
    """Rewards [n, P] and weights [n, P] for n resamples."""
    p = y.shape[0]
    if method == "pairs":
        w = _counts(jax.random.randint(key, (n, p), 0, p), p)
        return jnp.broadcast_to(y, (n, p)), w
    if method == "block":  # moving blocks of consecutive (correlated) points
        n_blocks = -(-p // block)
        starts = jax.random.randint(key, (n, n_blocks), 0, p - block + 1)
        idx = (starts[:, :, None] + jnp.arange(block)).reshape(n, -1)[:, :p]
        return jnp.broadcast_to(y, (n, p)), _counts(idx, p)
    residual = y - fitted  # residual bootstrap: refit the curve plus reshuffled residuals
    residual = residual - jnp.mean(residual)
    draws = residual[jax.random.randint(key, (n, p), 0, p)]
    return fitted + draws, jnp.ones((n, p), float)


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
) -> BootstrapResult:
    """Percentile bootstrap intervals for A, B, C_mid, r0 and predictions.

    Methods: "pairs" resamples points with replacement; "block" resamples runs of `block`
    consecutive points (default about P ** (1/3)), for evaluation points that are correlated
    along one run; "residual" keeps the points and adds resampled residuals of the point fit.
    All n refits run in one jitted, vmapped call.
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
    point = fit_sigmoid(curve.compute, curve.reward, r0, a_max=a_max, n_iter=n_iter)
    y = jnp.asarray(curve.reward, float)
    log_c = jnp.log(jnp.asarray(curve.compute, float))
    fitted = point.predict(jnp.asarray(curve.compute, float))
    ys, ws = _resample(jax.random.key(seed), y, fitted, n=n, method=method, block=block)
    held_r0 = jnp.broadcast_to(jnp.asarray(0.0 if r0 is None else r0, float), (n,))
    spec = FitSpec(a_max=float(a_max), fit_r0=r0 is None, n_iter=n_iter)
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
