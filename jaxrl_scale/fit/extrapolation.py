"""Does the curve predict? Fit on the early part of a run, forecast the rest, score the forecast.

The paper's validation protocol: fit up to half the compute (8B: 50k of 100k GPU-hours) and
predict the end.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_scale.fit.bootstrap import BootstrapResult, bootstrap_sigmoid
from jaxrl_scale.fit.data import CurveDataError, clean_curve


def early_cut(compute, fraction: float, min_points: int = 4) -> float:
    """The compute below which points are dropped as early transients: `fraction` of the last
    compute, lowered when that would leave fewer than `min_points` (0: keep everything)."""
    c = np.sort(np.asarray(compute, float))
    if not 0 <= fraction < 1:
        raise ValueError(f"c_min_fraction must be in [0, 1), got {fraction}")
    if fraction == 0 or c.size <= min_points:
        return 0.0
    return float(min(fraction * c[-1], c[-min_points]))


@dataclasses.dataclass(frozen=True)
class ExtrapolationReport:
    c_cut: float  # points with compute <= c_cut were fitted
    n_fit: int  # how many
    c_last: float  # the last observed compute, predicted from the early fit
    actual: float  # observed reward there
    predicted: float
    lo: float  # interval at `boot.level`
    hi: float
    boot: BootstrapResult

    @property
    def error(self) -> float:
        return self.predicted - self.actual

    @property
    def covered(self) -> bool:
        return self.lo <= self.actual <= self.hi


def extrapolation_check(
    compute,
    reward,
    *,
    fit_until: float | None = 0.5,
    c_cut: float | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    r0=None,
    level: float = 0.95,
    a_max: float = 1.0,
    method: str = "auto",
    c_min_fraction: float = 0.0,
    eval_size: int | None = None,
    eval_sd=None,
    r0_sd: float | None = None,
) -> ExtrapolationReport:
    """Fit points with C <= c_cut (default: fit_until x the last compute), predict the last one.

    Points below `c_min_fraction` x c_cut are left out of the fit (early transients, see
    `early_cut`). The interval is for the observed reward at the last point: the curve's
    bootstrap uncertainty plus evaluation noise. `eval_size` / `eval_sd` / `r0_sd`: the known
    sampling noise (bootstrap_sigmoid).
    """
    curve = clean_curve(compute, reward, a_max=a_max, sd=eval_sd)
    c_last = float(curve.compute[-1])
    if c_cut is None:
        if fit_until is None or not 0 < fit_until < 1:
            raise ValueError(f"fit_until must be a fraction in (0, 1), got {fit_until}")
        c_cut = fit_until * c_last
    fitted = curve.compute <= c_cut
    if fitted.all():
        raise CurveDataError(f"c_cut {c_cut:g} keeps every point; nothing is left to predict")
    early = fitted & (curve.compute >= early_cut(curve.compute[fitted], c_min_fraction))
    boot = bootstrap_sigmoid(
        curve.compute[early],
        curve.reward[early],
        n=n_boot,
        seed=seed,
        r0=r0,
        level=level,
        a_max=a_max,
        method=method,
        eval_size=eval_size,
        eval_sd=None if curve.sd is None else curve.sd[early],
        r0_sd=r0_sd,
    )
    # The forecast is of a measured eval point, so its interval includes evaluation noise.
    lo, mid, hi = (float(np.asarray(v)) for v in boot.predict_ci(c_last, observation_noise=True))
    return ExtrapolationReport(
        c_cut=float(c_cut),
        n_fit=int(early.sum()),
        c_last=c_last,
        actual=float(curve.reward[-1]),
        predicted=mid,
        lo=lo,
        hi=hi,
        boot=boot,
    )
