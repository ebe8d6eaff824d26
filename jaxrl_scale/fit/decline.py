"""Has a run peaked and started to fall? A test for a decline that accounts for the eval noise.

The sigmoid only rises, so a run that peaks and declines (entropy collapse, reward hacking, a
learning rate too high) is fitted as a rise to a plateau, and a wide enough interval then
"covers" its last point. This test asks the data directly.

Statistic: D = the best mean of `h` consecutive evals before the last `h` minus the mean of
the last `h`. Under the null hypothesis the expected curve never decreases; the least
favourable such curve is flat (any rise lowers D), so D's null distribution is that of flat
curves plus evaluation noise, simulated from the noise model the run's own residuals give
(an AR(1) along the run, `bootstrap.noise_model`, or a known sampling part plus an AR(1)
drift, `bootstrap.drift_model`), fitted on the evals up to the peak so that a decline is not
mistaken for noise. The run is declining when D exceeds the null's 1 - `alpha` quantile.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_scale.fit.data import Curve
from jaxrl_scale.fit.noise import drift_model, noise_model

ALPHA = 0.05
N_NULL = 4000


@dataclasses.dataclass(frozen=True)
class Decline:
    """A detected decline: the peak (the best window's last eval), how far the last evals fell
    below it, and the test's p-value."""

    peak_x: float  # compute at the end of the best window before the last
    peak: float  # that window's mean
    last: float  # the last window's mean
    drop: float  # peak - last
    p_value: float
    window: int  # evals per window

    def message(self, name: str = "run") -> str:
        return (
            f"{name}: declining: the evals peaked at {self.peak:.3f} (mean of {self.window} "
            f"evals ending at x = {self.peak_x:.4g}) and the last {self.window} average "
            f"{self.last:.3f}, a drop of {self.drop:.3f} (p = {self.p_value:.3g} against a "
            "curve that never falls, given the eval noise); a rising sigmoid does not "
            "describe this run"
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def window_size(points: int) -> int:
    return max(3, round(points / 10))


def _statistic(y: np.ndarray, h: int) -> tuple[np.ndarray, np.ndarray]:
    """D [...] and the best window's start [...] for series y [..., P]."""
    c = np.cumsum(np.concatenate([np.zeros(y.shape[:-1] + (1,)), y], axis=-1), axis=-1)
    means = (c[..., h:] - c[..., :-h]) / h  # [..., P - h + 1]
    last = means[..., -1]
    before = means[..., : means.shape[-1] - h]  # windows that end before the last one starts
    start = np.argmax(before, axis=-1)
    return np.max(before, axis=-1) - last, start


def _noise_draws(rng, residuals, jac, sampling_var, n: int):
    """(rho [n], innovation sd of drift [n], sampling sd [n, P] or 0) drawn from the noise
    posterior of a fit's residuals."""
    if sampling_var is None:
        model = noise_model(residuals, jac)
        pick = rng.choice(model.rho.size, size=n, p=model.weight)
        sd = np.sqrt(model.scale[pick] * model.dof / rng.chisquare(model.dof, size=n))
        return model.rho[pick], sd, 0.0
    model = drift_model(residuals, jac, sampling_var)
    pick = rng.choice(model.rho.size, size=n, p=model.weight)
    return model.rho[pick], model.tau[pick], np.sqrt(sampling_var)


def detect_decline(
    curve: Curve,
    *,
    r0: float | None = None,
    eval_size: int | None = None,
    alpha: float = ALPHA,
    seed: int = 0,
) -> Decline | None:
    """The decline in `curve` (fit.data.Curve, cleaned), or None when the data are consistent
    with a curve that never falls. Noise: the curve's own `sd` (known sampling sds) or a
    binomial sd from `eval_size` plus a drift, else an AR(1) of unknown size."""
    from scipy.optimize import isotonic_regression  # (0.25 s to import: at the first test)

    from jaxrl_scale.fit.bootstrap import _jacobian
    from jaxrl_scale.fit.sigmoid_fit import fit_sigmoid

    y = curve.reward
    p = y.size
    h = window_size(p)
    if p < 3 * h:  # too few evals for a peak window, a gap and a last window
        return None
    d, start = _statistic(y, h)
    if d <= 0:
        return None
    end = int(start) + h  # evals up to the peak window's end follow the rising model
    if end >= (6 if r0 is not None else 7):
        keep = slice(0, end)
        c_fit, y_fit = curve.compute[keep], y[keep]
        fit = fit_sigmoid(c_fit, y_fit, r0=r0)
        fitted = np.asarray(fit.predict(c_fit))
        jac = _jacobian(fit, c_fit, r0 is None)
    else:
        # The peak comes too early for a rising fit of its own, and a rising fit through the
        # fall would take the fall for noise (a run that collapses after its first evals would
        # never be called declining). The noise is read after the peak instead, around the
        # least-squares non-increasing fit, which is locally the projection onto its constant
        # blocks: those blocks' indicators are its Jacobian.
        keep = slice(end, p)
        y_fit = y[keep]
        iso = isotonic_regression(y_fit, increasing=False)
        fitted = np.asarray(iso.x)
        jac = np.zeros((y_fit.size, iso.blocks.size - 1))
        for k, (lo, hi) in enumerate(zip(iso.blocks[:-1], iso.blocks[1:], strict=True)):
            jac[lo:hi, k] = 1.0
    residuals = y_fit - fitted
    sampling_var = None
    if curve.sd is not None:
        sampling_var = np.maximum(curve.sd[keep], 1e-6) ** 2
    elif eval_size:
        rate = np.clip(fitted, 0.5 / eval_size, 1 - 0.5 / eval_size)
        sampling_var = rate * (1 - rate) / eval_size
    if not (np.isfinite(residuals).all() and np.isfinite(jac).all()):
        return None
    rng = np.random.default_rng(seed)
    try:
        rho, drift_sd, sampling_sd = _noise_draws(rng, residuals, jac, sampling_var, N_NULL)
    except ValueError:  # no residual degree of freedom
        return None
    # Flat null curves: AR(1) noise with each draw's (rho, sd), plus sampling noise at the
    # level of the last fitted evals (the sd of a rate changes little near a plateau).
    z = rng.standard_normal((N_NULL, p))
    e = np.empty((N_NULL, p))
    e[:, 0] = z[:, 0]
    for t in range(1, p):
        e[:, t] = rho * e[:, t - 1] + np.sqrt(1 - rho * rho) * z[:, t]
    null = e * drift_sd[:, None]
    if not np.isscalar(sampling_sd):
        null = null + rng.standard_normal((N_NULL, p)) * float(np.sqrt(np.mean(sampling_sd**2)))
    null_d, _ = _statistic(null, h)
    p_value = (1 + np.sum(null_d >= d)) / (1 + N_NULL)
    if p_value >= alpha:
        return None
    last = float(np.mean(y[-h:]))
    return Decline(
        peak_x=float(curve.compute[end - 1]),
        peak=last + float(d),
        last=last,
        drop=float(d),
        p_value=float(p_value),
        window=h,
    )
