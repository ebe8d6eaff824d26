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
from jaxrl_scale.fit.level import Level, fit_level
from jaxrl_scale.fit.noise import drift_model, noise_model
from jaxrl_scale.fit.profile import (
    IDENTIFIED,
    LOWER,
    NOT_IDENTIFIED,
    Profile,
    inflated_variance,
    profile_a,
)
from jaxrl_scale.fit.sigmoid_fit import B_MIN, FitResult, FitSpec, fit_batch, pad_curves

PARAMS = ("a", "b", "c_mid", "r0")
Method = Literal["auto", "pairs", "residual", "block"]
METHODS = ("auto", "pairs", "residual", "block")
# With A identified by its profile, this many converged refits still give A an interval (the
# envelope with the profile's); B and C_mid need 90%.
PROFILE_REFITS = 0.5


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
    # "auto": the posterior-mean AR(1) coefficient of the evaluation noise along the run
    # (0 for the other methods).
    autocorrelation: float = 0.0
    noise_sd: float = 0.0  # evaluation noise sd for forecasts
    a_max: float = 1.0
    # "auto": each resample's noise sd [n] (drawn from its posterior); forecasts add noise of
    # that size to each resample's prediction. None: `noise_sd` for every resample.
    noise_samples: jax.Array | None = None
    # "auto": which scheme drew each resample [n] (0: parametric AR(1), 1: pairs). Intervals
    # are the envelope of each scheme's percentile interval. None: one scheme.
    groups: np.ndarray | None = None
    # With a known sampling noise (`eval_size` or `eval_sd`): each resample's drift sd [n], the
    # eval set's size (binomial sampling sd at any predicted rate) or else the sampling sd of
    # the last eval (what a forecast's eval is assumed to carry).
    drift_samples: jax.Array | None = None
    eval_size: int | None = None
    sampling_sd_last: float | None = None
    c_min: float = 0.0  # the smallest compute in the data
    y_mean: float = math.nan  # the mean eval (a run whose mean is not above R0 never rose)
    # A's profile likelihood (profile.py): whether the data pin A down, bound it from below
    # only, or neither. None: no fit to profile (too few points).
    profile: Profile | None = None
    # Where the sigmoid does not describe the evals (no point fit, too few points for an
    # interval, or a ceiling its profile leaves open on both sides): the level the evals
    # after R0 hold (level.py), or why they hold none (a trend). None: the sigmoid fitted.
    flat: Level | None = None
    r0_held: bool = False  # R0 was given (the step-0 eval), not fitted

    @property
    def level_bounds_a(self) -> bool:
        """Whether the level says more of A than the model does: A > R0 holds anyway, so a
        level at a held R0 bounds nothing."""
        return self.on_level and (not self.r0_held or self.flat.lower > float(self.fit.r0))

    @property
    def on_level(self) -> bool:
        """Whether the evals hold a level rather than rise: the sigmoid does not describe them
        (no point fit, no spare point, A open on both sides, or no better fit than a level)
        and they show no trend. Then forecasts are the level's, and A >= its lower bound where
        that says more than R0 does (`level_bounds_a`)."""
        return self.flat is not None and self.flat.holds

    @property
    def converged_fraction(self) -> float:
        return float(jnp.mean(self.converged))

    @property
    def why_not(self) -> dict[str, str | None]:
        """Per parameter ("a", "b", "c_mid"): None when the data pin it down, else the reason.

        A's verdict comes from its profile likelihood (profile.py): identified when the data
        rule out ceilings both below and above the fit; else the reason, the one-sided bound
        included where the data rule out only lower ceilings (`a_lower`). B and C_mid are
        identified when the data show the rise: C_mid's interval lies within the evaluated
        compute. Neither, when the fit did not converge (B and C_mid: nor 90% of its
        resamples).
        """
        fmt = lambda v: f"{v:.4g}"  # noqa: E731
        if self.on_level and (self.level_bounds_a or not self._profile_speaks):
            flat = self.flat
            a = (f"A >= {flat.lower:.3f} at {self.level:.0%}: {flat.reason}; a sigmoid never "
                 "falls, so its ceiling is at least the level, and a higher one is not ruled "
                 "out")  # fmt: skip
            if not self.level_bounds_a:
                a = (f"{flat.reason}, no higher than R0 = {float(self.fit.r0):.3f}: there is "
                     "no rise to read a ceiling from")  # fmt: skip
            return {
                "a": a,
                "b": "the evals show no rise to place B and C_mid",
                "c_mid": "the evals show no rise to place B and C_mid",
            }  # fmt: skip
        if not bool(self.fit.converged):
            reason = "the fit did not converge"
            c_mid, a, r0 = float(self.fit.c_mid), float(self.fit.a), float(self.fit.r0)
            if self.y_mean <= r0:  # no rise: a run that stays at or falls below its start
                reason += (
                    f": the evals do not rise above R0 = {r0:.3g} (their mean is "
                    f"{self.y_mean:.3g}); there is no rise for a sigmoid to describe"
                )
            elif c_mid > self.c_max:
                reason += (
                    f": the data do not reach the curve's inflection (its C_mid runs to "
                    f"{fmt(c_mid)}, beyond the last point at {fmt(self.c_max)})"
                )
            elif a >= self.a_max - 1e-3:
                reason += f": A runs to its bound a_max = {self.a_max}"
            if self.flat is not None:  # (a trend: no level either)
                reason += f"; nor do they hold a level: {self.flat.reason}"
            return dict.fromkeys(("a", "b", "c_mid"), reason)
        if self.converged_fraction < 0.9:
            reason = (
                f"only {self.converged_fraction:.0%} of the bootstrap refits converged "
                "(at least 90% are needed for an interval)"
            )
            out = dict.fromkeys(("a", "b", "c_mid"), reason)
            if self.profile is not None and self.profile.verdict != IDENTIFIED:
                out["a"] = self.profile.reason
            elif self.profile is not None and self.converged_fraction >= PROFILE_REFITS:
                out["a"] = None  # A's interval joins the profile's (bootstrap_sigmoid)
            return out
        lo, hi = self.ci["c_mid"]
        out: dict[str, str | None] = {"a": None, "b": None, "c_mid": None}
        if hi > self.c_max:
            out["a"] = (
                f"the data do not reach the curve's inflection: C_mid's interval reaches "
                f"{fmt(hi)}, beyond the last point at {fmt(self.c_max)}"
            )
        elif self.ci["a"][1] >= self.a_max - 1e-3:
            out["a"] = f"A's interval reaches its bound a_max = {self.a_max}"
        if lo < self.c_min:
            out["b"] = out["c_mid"] = (
                f"the curve rose before the first eval: C_mid's interval reaches down to "
                f"{fmt(lo)}, below the first point at {fmt(self.c_min)}"
            )
        elif hi > self.c_max:
            out["b"] = out["c_mid"] = out["a"]
        if self.profile is not None:  # A's verdict is its likelihood's
            out["a"] = None if self.profile.verdict == IDENTIFIED else self.profile.reason
        return out

    @property
    def a_verdict(self) -> str:
        """A's verdict: "identified", "lower bound" (A >= `a_lower` at `level`) or "not
        identified"."""
        if self.level_bounds_a:
            return LOWER
        if self.on_level and not self._profile_speaks:
            return NOT_IDENTIFIED
        if self.profile is not None and bool(self.fit.converged):
            if self.profile.verdict == IDENTIFIED and not self.identifiable:
                return NOT_IDENTIFIED  # pinned down, but too few refits for an interval
            return self.profile.verdict
        return IDENTIFIED if self.identifiable else NOT_IDENTIFIED

    def gain_left(self, c=None) -> float:
        """The upper end (at `level`) of A minus the curve at compute `c` (default: the
        last point) over the converged resamples: how much more the run can gain."""
        c = self.c_max if c is None else c
        s, keep = self.samples, np.asarray(self.converged)
        gain = np.asarray(s["a"] - sigmoid(c, s["a"], s["b"], s["c_mid"], s["r0"]))[keep]
        if gain.size == 0:
            return math.nan
        return float(np.quantile(gain, 1 - (1 - self.level) / 2))

    @property
    def a_lower(self) -> float | None:
        """The one-sided lower bound on A at `level` where A is bounded below only (else
        None): the data rule out a lower ceiling, not a higher one."""
        if self.a_verdict != LOWER:
            return None
        return self.flat.lower if self.level_bounds_a else self.profile.lower

    @property
    def _profile_speaks(self) -> bool:
        """Whether A's profile gives a verdict of its own (a converged fit it identifies or
        bounds), which a level that bounds nothing leaves standing."""
        return (self.profile is not None and bool(self.fit.converged)
                and self.profile.verdict != NOT_IDENTIFIED)  # fmt: skip

    @property
    def identified(self) -> dict[str, bool]:
        """Per parameter: whether the data pin it down (see `why_not`)."""
        return {k: v is None for k, v in self.why_not.items()}

    @property
    def identifiable(self) -> bool:
        """Whether the ceiling A is identified (the parameter a forecast needs)."""
        return self.why_not["a"] is None

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
            identified=self.identified,
            not_identified={k: v for k, v in self.why_not.items() if v is not None},
            a_verdict=self.a_verdict,
            bootstrap_converged=self.converged_fraction,
            level=self.level,
            method=self.method,
            autocorrelation=self.autocorrelation,
            noise_sd=self.noise_sd,
            eval_size=self.eval_size,
        )
        if self.a_lower is not None:  # bounded below only: the one-sided bound
            out["a_lower"] = self.a_lower
        if self.flat is not None:  # no sigmoid fit: the level the evals hold, or why none
            out["held_level"] = self.flat.to_dict()
        return out

    def predict_ci(self, c, *, observation_noise: bool = False, seed: int = 0):
        """(lo, mid, hi) predicted reward at compute `c`, each shaped like `c`: percentiles over
        converged resamples, around the point fit's prediction.

        With `observation_noise`, the interval is for a new *measurement* at `c` (the curve's
        uncertainty plus evaluation noise: each resample's own noise sd for "auto", else the
        point fit's), which is what a forecast of an observed eval point must cover.
        Evals that hold a level (`on_level`): the level's, the same at every `c`.
        """
        c = jnp.asarray(c, float)
        if self.on_level:
            lo, hi = self.flat.predict if observation_noise else self.flat.interval
            return (jnp.full(c.shape, lo), jnp.full(c.shape, self.flat.mean),
                    jnp.full(c.shape, hi))  # fmt: skip
        keep = np.asarray(self.converged)
        mid = self.fit.predict(c)
        if not keep.any():  # no resample converged: there is no interval to give
            nan = jnp.full(c.shape, jnp.nan)
            return nan, mid, nan
        # Every resample is predicted (NaN where it did not converge) and the kept ones are
        # picked afterwards: shapes stay fixed, so a new count of converged resamples does not
        # compile the arithmetic again.
        expand = (-1,) + (1,) * c.ndim
        params = [jnp.reshape(self.samples[k], expand) for k in PARAMS]
        preds = sigmoid(c, *params)
        if observation_noise:
            sd = self.noise_sd
            if self.noise_samples is not None:
                sd = jnp.reshape(self.noise_samples, expand)
            if self.drift_samples is not None:  # known sampling noise plus the drawn drift
                drift = jnp.reshape(self.drift_samples, expand)
                if self.eval_size:
                    p = jnp.clip(preds, 0.0, self.a_max)
                    sampling_var = p * (1 - p) / self.eval_size
                else:
                    sampling_var = self.sampling_sd_last**2
                sd = jnp.sqrt(sampling_var + drift**2)
            preds = preds + jax.random.normal(jax.random.key(seed), preds.shape) * sd
        preds = np.clip(np.asarray(preds)[keep], 0.0, self.a_max)
        groups = np.zeros(keep.shape, int) if self.groups is None else self.groups
        lo, hi = _envelope(preds, groups[keep], self.level)
        return jnp.asarray(lo), mid, jnp.asarray(hi)


def _envelope(values, groups, level: float):
    """(lo, hi) along axis 0: the widest of each group's percentile interval at `level`
    (NaN when no values)."""
    tail = (1 - level) / 2
    parts = [np.quantile(values[groups == g], [tail, 1 - tail], axis=0) for g in np.unique(groups)]
    if not parts:
        nan = np.full(values.shape[1:], np.nan)
        return nan, nan
    return np.min([q[0] for q in parts], axis=0), np.max([q[1] for q in parts], axis=0)


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


def _ar1_paths(key, rho, width: int):
    """[n, W] AR(1) paths along the run with unit marginal variance, coefficient rho [n]."""
    eps = jax.random.normal(key, (width, rho.shape[0]))
    innovation = jnp.sqrt(1.0 - rho * rho)

    def step(prev, eps_t):
        e = rho * prev + innovation * eps_t
        return e, e

    _, rest = jax.lax.scan(step, eps[0], eps[1:])
    return jnp.concatenate([eps[:1], rest]).T


@functools.partial(jax.jit, static_argnames=("n",))
def _simulate(key, fitted, p, rho, log_weight, scale, dof, a_max, *, n: int):
    """Rewards [n, W], weights [n, W] and noise sds [n] for n parametric resamples: the point
    fit's curve plus AR(1) noise, with (rho, sigma) drawn from their posterior (`NoiseModel`)
    for each resample. Only the first `p` of W points are present."""
    width = fitted.shape[0]
    k_rho, k_chi, k_eps = jax.random.split(key, 3)
    pick = jax.random.categorical(k_rho, log_weight, shape=(n,))
    r = rho[pick]
    chi2 = 2.0 * jax.random.gamma(k_chi, dof / 2.0, (n,))
    sd = jnp.sqrt(scale[pick] * dof / chi2)
    z = _ar1_paths(k_eps, r, width)
    present = jnp.arange(width) < p
    ys = jnp.where(present, jnp.clip(fitted + sd[:, None] * z, 0.0, a_max), 0.0)
    return ys, jnp.broadcast_to(present.astype(float), (n, width)), sd


@functools.partial(jax.jit, static_argnames=("n",))
def _simulate_drift(key, fitted, p, sampling_sd, rho, tau, log_weight, a_max, *, n: int):
    """Rewards [n, W], weights [n, W] and drift sds [n] for n parametric resamples: the point
    fit's curve plus known sampling noise (sd [W]) plus AR(1) drift with (rho, tau) drawn
    from their posterior (`DriftModel`, flattened grid [G]). Only the first `p` of W points
    are present."""
    width = fitted.shape[0]
    k_pick, k_samp, k_drift = jax.random.split(key, 3)
    pick = jax.random.categorical(k_pick, log_weight, shape=(n,))
    r, t = rho[pick], tau[pick]
    drift = _ar1_paths(k_drift, r, width) * t[:, None]  # [n, W]
    sampling = jax.random.normal(k_samp, (n, width)) * sampling_sd
    present = jnp.arange(width) < p
    ys = jnp.where(present, jnp.clip(fitted + sampling + drift, 0.0, a_max), 0.0)
    return ys, jnp.broadcast_to(present.astype(float), (n, width)), t


def resample(curve, fitted, *, n: int, seed: int, method: Method = "pairs", block=None):
    """(rewards [n, P], weights [n, P]) of n resamples of a clean curve (fit.data.Curve) whose
    point fit predicts `fitted` [P] (used by the residual method). "auto" is not a resampling
    of the points and needs the fit itself: use `bootstrap_sigmoid`."""
    if method not in ("pairs", "block", "residual"):
        raise ValueError(f"resample: method must be pairs, block or residual, got {method!r}")
    p = curve.compute.size
    block = block or max(2, round(p ** (1 / 3)))
    y = jnp.asarray(curve.reward, float)
    return _resample(jax.random.key(seed), y, jnp.asarray(fitted, float), p, n=n,
                     method=method, block=block)  # fmt: skip


def _jacobian(point: FitResult, compute, fit_r0: bool) -> np.ndarray:
    """d curve / d (A, B, C_mid[, R0]) at the point fit, [P, K]."""
    names = PARAMS if fit_r0 else PARAMS[:3]
    theta = jnp.array([float(getattr(point, k)) for k in names])
    c = jnp.asarray(compute, float)

    def curve(t):
        r0 = t[3] if fit_r0 else point.r0
        return sigmoid(c, t[0], t[1], t[2], r0)

    return np.asarray(jax.jacfwd(curve)(theta))


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
    n_iter: int = 40,
    b_min: float = B_MIN,
    pad_to: int | None = None,
    eval_size: int | None = None,
    eval_sd=None,
    r0_sd: float | None = None,
) -> BootstrapResult:
    """Percentile bootstrap intervals for A, B, C_mid, r0 and predictions.

    Methods:
      "auto" (the default): a parametric bootstrap that adapts to how the evaluation noise is
        correlated along the run. The residuals give a posterior over an AR(1) noise model
        (`noise_model`: independent noise is rho = 0); each resample draws (rho, sigma) from
        it, adds such noise to the point fit's curve and refits. Correlated noise (successive
        evals drifting together) widens the intervals, and so does a short run, which cannot
        rule correlation out. Half the resamples are pairs resamples instead, and each interval
        is the wider envelope of the two schemes' intervals: where the fit is barely
        identified, resampling the points shows how far it can move.
        With the evaluation's sampling noise known (`eval_size`: the eval set's size, for a
        binomial sd sqrt(p (1 - p) / eval_size) at the fitted rate; or `eval_sd`: each eval's
        sampling sd, e.g. the run's logged `eval_sampling_sd`), the noise is that plus an AR(1)
        drift of unknown size (`drift_model`), every resample is parametric, and a held `r0`
        is redrawn in each resample with its own sampling sd (`r0_sd`, or the binomial sd).
      "pairs" resamples points with replacement; "block" resamples runs of `block`
        consecutive points (default about P ** (1/3)); "residual" keeps the points and adds
        resampled residuals of the point fit. These assume independent noise (block: short
        range) and cover far less than nominal when it is not.
    benchmarks/bench_calibration.py and bench_forecasts.py measure the coverage.
    All n refits run in one jitted, vmapped call. `pad_to` pads the curve with weight-0 points
    to that many, so a growing curve (an online forecast) reuses one compiled program.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if eval_size is not None and (int(eval_size) != eval_size or eval_size < 1):
        raise ValueError(f"eval_size must be a positive whole number of problems, got {eval_size}")
    curve = clean_curve(compute, reward, a_max=a_max, c_min=c_min, sd=eval_sd)
    p = curve.compute.size
    block = block or max(2, round(p ** (1 / 3)))
    if method == "block" and not 1 <= block <= p:
        raise ValueError(f"block must be in [1, {p}], got {block}")
    width = max(p, pad_to or 0)
    log_c, y, w = (jnp.asarray(v[0]) for v in pad_curves([curve], width))
    held_r0 = jnp.broadcast_to(jnp.asarray(0.0 if r0 is None else r0, float), (n,))
    spec = FitSpec(a_max=float(a_max), fit_r0=r0 is None, n_iter=n_iter, b_min=b_min)
    point = jax.tree.map(
        lambda v: v[0], fit_batch(log_c, y[None], w[None], held_r0[:1], jnp.zeros((1,)), spec=spec)
    )
    fitted = jnp.where(w > 0, point.predict(jnp.exp(log_c)), 0.0)
    free = 3 + int(spec.fit_r0)  # A, B, C_mid (+ R0)
    noise_samples, rho, groups, drift = None, 0.0, None, None
    noise_sd = float(point.rmse) * math.sqrt(p / max(p - free, 1))
    profile_var = noise_sd**2
    profile_dof: int | None = max(p - free, 1)  # the variance read from these residuals
    key = jax.random.key(seed)
    known = eval_size is not None or curve.sd is not None
    extra: dict = {}
    if method == "auto":
        residuals = np.asarray(y - fitted)[:p]
        jac = _jacobian(point, curve.compute, spec.fit_r0)
        if not (np.isfinite(residuals).all() and np.isfinite(jac).all()) or p <= free:
            flat = _level(curve, eval_size, level, a_max, seed)
            return _no_interval(point, n, level, method, curve, a_max, flat, r0 is not None)
        if known:
            if eval_size is not None:
                rate = np.clip(np.asarray(fitted)[:p], 0.5 / eval_size, 1 - 0.5 / eval_size)
                sampling_var = rate * (1 - rate) / eval_size
            else:
                sampling_var = np.maximum(curve.sd, 1e-6) ** 2
            model = drift_model(residuals, jac, sampling_var)
            rho, noise_sd = model.mean_rho, model.sd
            drift_var = float(np.sum(model.weight * model.tau**2))
            profile_var = inflated_variance(float(np.mean(sampling_var)), drift_var, rho)
            profile_dof = None  # the sampling part known
            sampling_sd = np.zeros(width)
            sampling_sd[:p] = np.sqrt(sampling_var)
            key, k_r0 = jax.random.split(key)
            ys, ws, drift = _simulate_drift(
                key, fitted, p, jnp.asarray(sampling_sd), jnp.asarray(model.rho),
                jnp.asarray(model.tau), jnp.log(jnp.asarray(model.weight) + 1e-300),
                float(a_max), n=n,
            )  # fmt: skip
            if r0 is not None:  # the step-0 eval is a measurement too
                sd0 = r0_sd
                if sd0 is None and eval_size is not None:
                    rate0 = min(max(float(r0), 0.5 / eval_size), 1 - 0.5 / eval_size)
                    sd0 = math.sqrt(rate0 * (1 - rate0) / eval_size)
                elif sd0 is None:  # only the evals' own sds: the first one's
                    sd0 = float(curve.sd[0])
                noise0 = jax.random.normal(k_r0, (n,)) * sd0
                held_r0 = jnp.clip(held_r0 + noise0, 0.0, a_max - 1e-3)
            extra = dict(
                drift_samples=drift,
                eval_size=None if eval_size is None else int(eval_size),
                sampling_sd_last=float(np.sqrt(sampling_var[-1])),
            )
        else:
            noise = noise_model(residuals, jac)
            rho, noise_sd = noise.mean_rho, noise.sd
            profile_var = inflated_variance(0.0, noise_sd**2, rho)
            key, k_pairs = jax.random.split(key)
            ys, ws, sds = _simulate(
                key, fitted, p, jnp.asarray(noise.rho),
                jnp.log(jnp.asarray(noise.weight) + 1e-300), jnp.asarray(noise.scale),
                float(noise.dof), float(a_max), n=n - n // 2,
            )  # fmt: skip
            # Pairs resamples too: where the fit is barely identified a parametric bootstrap
            # stays near the point fit's curve, and resampling the points shows how far it
            # can move.
            y_pairs, w_pairs = _resample(
                k_pairs, y, fitted, p, n=n // 2, method="pairs", block=block
            )
            ys, ws = jnp.concatenate([ys, y_pairs]), jnp.concatenate([ws, w_pairs])
            noise_samples = jnp.concatenate([sds, sds[: n // 2]])
            groups = np.repeat([0, 1], [n - n // 2, n // 2])
    else:
        ys, ws = _resample(key, y, fitted, p, n=n, method=method, block=block)
    fits = fit_batch(log_c, ys, ws, held_r0, jnp.zeros((n,), float), spec=spec)
    samples = {k: getattr(fits, k) for k in PARAMS}
    keep = np.asarray(fits.converged)
    kept_groups = (np.zeros(keep.shape, int) if groups is None else groups)[keep]
    ci = {}
    for k, v in samples.items():
        lo, hi = _envelope(np.asarray(v)[keep], kept_groups, level)
        ci[k] = (float(lo), float(hi))
    c_max = float(curve.compute[-1])
    profile = None  # (a one-sided bound needs level > 0.5)
    if level > 0.5:
        profile = profile_a(log_c, y, w, point, spec, noise_var=profile_var, level=level,
                            dof=profile_dof, held_r0=0.0 if r0 is None else float(r0))  # fmt: skip
    # A sigmoid that did not fit, whose ceiling the likelihood leaves open on both sides, or
    # that fits no better than a level, says nothing the level does not: the level its evals
    # hold is the run's model (where they show no trend).
    undescribed = not bool(point.converged) or profile is not None and (
        profile.verdict == NOT_IDENTIFIED
        or not _rises(curve.reward, float(point.rmse), r0, profile_var, profile_dof, level)
    )  # fmt: skip
    converged = float(np.mean(keep))
    if profile is not None and profile.verdict == IDENTIFIED and PROFILE_REFITS <= converged < 0.9:
        # The refits that fail are B and C_mid running off (a rise before the first eval),
        # not A: its interval is the envelope of the converged refits' and the profile's.
        ci["a"] = (min(ci["a"][0], profile.interval[0]), max(ci["a"][1], profile.interval[1]))
    return BootstrapResult(
        point, samples, fits.converged, ci, level, method, c_max, rho, noise_sd, a_max,
        noise_samples, groups, c_min=float(curve.compute[0]),
        y_mean=float(np.mean(curve.reward)), profile=profile,
        flat=_level(curve, eval_size, level, a_max, seed) if undescribed else None,
        r0_held=r0 is not None,
        **extra,
    )  # fmt: skip


def _rises(y, rmse: float, r0, noise_var: float, dof: int | None, level: float) -> bool:
    """Whether the sigmoid fits the evals (and a held R0, its value at compute 0) better than
    one level does, by more than noise explains: a likelihood-ratio test with the noise
    variance per point `noise_var` (chi-square, or F with `dof` where the variance was read
    from the same residuals), on the parameters the sigmoid adds (B and C_mid, and R0 where
    fitted)."""
    y = np.asarray(y, np.float64)
    sse_sigmoid = rmse**2 * y.size
    values = y if r0 is None else np.append(y, float(r0))
    sse_level = float(np.sum((values - values.mean()) ** 2))
    extra = 2 + (r0 is None)
    if not (math.isfinite(noise_var) and noise_var > 0 and math.isfinite(sse_sigmoid)):
        return True  # (no noise to judge by: the sigmoid stands)
    from scipy.stats import chi2  # (scipy.stats: half a second to import; here, not at start)
    from scipy.stats import f as f_dist

    statistic = (sse_level - sse_sigmoid) / noise_var
    if dof is None:
        return statistic > float(chi2.ppf(level, extra))
    return statistic / extra > float(f_dist.ppf(level, extra, max(dof, 1)))


def _level(curve, eval_size, level, a_max, seed) -> Level | None:
    """The level the evals hold, with the sampling noise known as the fit knew it: for a
    curve the sigmoid does not describe. R0 is not one of the evals: a run that rose before
    its first eval holds its level above R0, one whose RL does nothing at it."""
    return fit_level(curve.compute, curve.reward, eval_size=eval_size, eval_sd=curve.sd,
                     a_max=a_max, level=level, seed=seed)  # fmt: skip


def _no_interval(point, n, level, method, curve, a_max, flat=None,
                 r0_held=False) -> BootstrapResult:  # fmt: skip
    """A fit with no spare point (or a non-finite one) says nothing about its noise: no
    resample counts as converged and every interval is NaN."""
    samples = {k: jnp.full((n,), jnp.nan) for k in PARAMS}
    ci = dict.fromkeys(PARAMS, (math.nan, math.nan))
    c_max = float(curve.compute[-1])
    return BootstrapResult(
        point, samples, jnp.zeros((n,), bool), ci, level, method, c_max, a_max=a_max,
        c_min=float(curve.compute[0]), y_mean=float(np.mean(curve.reward)), flat=flat,
        r0_held=r0_held,
    )  # fmt: skip
