"""The online forecast: while a run trains, fit the ScaleRL sigmoid to its eval curve so far.

forecaster = OnlineForecast(cfg.forecast, total_steps=300)
forecaster.observe(step=0, compute=0.0, rate=0.31)          # R0: the eval before any RL
fields = forecaster.observe(step=25, compute=3e12, rate=0.40)  # a dict for the metrics row,
                                                               # or None when not due
Every `forecast.every` evaluations (once there are `forecast.min_points` after step 0) the
sigmoid is refitted with R0 held at the step-0 eval and bootstrap intervals, and the row gets
the predicted ceiling A [lo, hi], B, C_mid and the pass rate an eval at the compute budget
(default: the run's projected end) would measure, its interval including the eval's noise.
`forecast_identified` says which parameters the data pin down ("A" when the run rose before
its first evals, "A, B, C_mid" when they show the rise too). Until the data show the curve
bending over, A is not pinned down (many ceilings fit a curve that is still concave), so the
row says `forecast_status: "not identifiable yet"`, carries no numbers and gives the reason
(`forecast_reason`, which also says when a status seen before was lost). A run whose evals
fell after a peak by more than their noise allows is `forecast_status: "declining"`
(`forecast.stop_when_declining` stops it). A run whose evals hold a level with no rise (the
sigmoid has nothing to fit: fit/level.py) is `forecast_status: "level"`: the level's forecast
at the budget (`forecast_at_budget` and its interval) and `forecast_a_lower`, the level's
one-sided bound, since a ceiling is at least what a run holds.

Each fit pads the curve to a bucket of 8, 16, 32, ... points (weight-0 padding), so a run
compiles the bootstrap a handful of times, not once per evaluation.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np

from jaxrl_scale.fit import Curve, CurveDataError, bootstrap_sigmoid, clean_curve
from jaxrl_scale.fit.config import ForecastConfig
from jaxrl_scale.fit.curves import sigmoid
from jaxrl_scale.fit.decline import Decline, detect_decline
from jaxrl_scale.fit.extrapolation import early_cut
from jaxrl_scale.fit.report import identified_label, verdict_line

NOT_IDENTIFIABLE = "not identifiable yet"
DECLINING = "declining"
LEVEL = "level"  # no rise: the evals hold a level (the forecast is the level's)


@dataclasses.dataclass(frozen=True)
class Forecast:
    """One refit of the eval curve. Numbers are None unless `status == "ok"` (and the
    forecast at the budget with "level")."""

    status: str  # "ok" | "level" | "declining" | "not identifiable yet" | "too few points" |
    # "fit failed"
    points: int  # evaluations fitted (after step 0)
    budget: float  # compute the pass rate is predicted at
    reason: str | None = None  # why A is not identified (or the decline), when not "ok"
    identified: str = "none"  # which parameters the data pin down: "A, B, C_mid" / "A" / "none"
    decline: Decline | None = None
    a: float | None = None
    a_ci: tuple[float, float] | None = None
    b: float | None = None
    c_mid: float | None = None
    at_budget: float | None = None
    at_budget_ci: tuple[float, float] | None = None
    gain_left_hi: float | None = None  # upper bound of A minus the fitted pass rate now
    left_out: int = 0  # early evaluations below the c_min_fraction cut, not fitted
    a_verdict: str = "not identified"  # A's profile likelihood: "identified" / "lower bound"
    a_lower: float | None = None  # A >= a_lower at `level`, when bounded below only
    verdict: str | None = None  # the one line a person acts on (report.verdict_line)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def row(self) -> dict:
        """Fields for a metrics row (TensorBoard takes the numeric ones)."""
        out = {
            "forecast_status": self.status,
            "forecast_points": self.points,
            "forecast_budget": self.budget,
            "forecast_left_out": self.left_out,
            "forecast_identified": self.identified,
            "forecast_a_verdict": self.a_verdict,
        }
        if self.a_lower is not None:
            out["forecast_a_lower"] = self.a_lower
        if self.verdict is not None:
            out["forecast_verdict"] = self.verdict
        if self.reason is not None:
            out["forecast_reason"] = self.reason
        if self.decline is not None:
            out.update(
                forecast_decline_peak_x=self.decline.peak_x,
                forecast_decline_drop=self.decline.drop,
                forecast_decline_p=self.decline.p_value,
            )
        if self.status == LEVEL:
            out.update(
                forecast_at_budget=self.at_budget,
                forecast_at_budget_lo=self.at_budget_ci[0],
                forecast_at_budget_hi=self.at_budget_ci[1],
            )
        if self.ok:
            out.update(
                forecast_a=self.a,
                forecast_a_lo=self.a_ci[0],
                forecast_a_hi=self.a_ci[1],
                forecast_b=self.b,
                forecast_c_mid=self.c_mid,
                forecast_at_budget=self.at_budget,
                forecast_at_budget_lo=self.at_budget_ci[0],
                forecast_at_budget_hi=self.at_budget_ci[1],
                forecast_gain_left_hi=self.gain_left_hi,
            )
        return out

    def describe(self) -> str:
        """What the forecast says, ending with its one-line verdict."""
        if self.status == LEVEL:
            lo, hi = self.at_budget_ci
            text = (f"forecast: level ({self.points} evals): at budget {self.at_budget:.3f} "
                    f"[{lo:.3f}, {hi:.3f}]: {self.reason}")  # fmt: skip
        elif not self.ok:
            why = f": {self.reason}" if self.reason else ""
            text = f"forecast: {self.status} ({self.points} evals){why}"
        else:
            text = (
                f"forecast: A {self.a:.3f} [{self.a_ci[0]:.3f}, {self.a_ci[1]:.3f}] "
                f"(identified: {self.identified})  "
                f"at budget {self.at_budget:.3f} [{self.at_budget_ci[0]:.3f}, "
                f"{self.at_budget_ci[1]:.3f}]  gain left <= {self.gain_left_hi:.3f}"
            )
        return text if self.verdict is None else f"{text}\n  verdict: {self.verdict}"


def fit_forecast(
    compute,
    rate,
    r0: float,
    budget: float,
    *,
    n_boot: int = 1000,
    level: float = 0.95,
    method: str = "auto",
    seed: int = 0,
    min_points: int = 4,
    c_min_fraction: float = 0.0,
    eval_sd=None,
    r0_sd: float | None = None,
) -> Forecast:
    """Fit eval points (compute > 0) with R0 held at `r0`; predict the pass rate an eval at
    `budget` would measure. Points below `c_min_fraction` of the latest compute are left out
    (fit.early_cut). `eval_sd` [P] / `r0_sd`: each eval's known sampling sd (the run's
    `eval_sampling_sd`), which sharpens the intervals."""
    compute, rate = np.asarray(compute, float), np.asarray(rate, float)
    late = compute >= early_cut(compute, c_min_fraction, min_points)
    left_out = int((~late).sum())
    compute, rate = compute[late], rate[late]
    sd = None if eval_sd is None else np.asarray(eval_sd, float)[late]
    points = int(compute.size)
    if points < min_points:
        return Forecast("too few points", points, budget, left_out=left_out)
    width = max(8, 1 << (points - 1).bit_length())
    try:
        with warnings.catch_warnings():  # repairs (sorting, averaging) are fine here
            warnings.simplefilter("ignore")
            boot = bootstrap_sigmoid(
                compute, rate, n=n_boot, seed=seed, r0=r0, level=level, method=method,
                pad_to=width, eval_sd=sd, r0_sd=r0_sd,
            )  # fmt: skip
            decline = detect_decline(clean_curve(compute, rate, sd=sd), r0=r0, seed=seed)
    except CurveDataError as e:
        return Forecast(f"fit failed: {e}", points, budget, left_out=left_out)
    identified = identified_label(boot.identified)
    said = dict(a_verdict=boot.a_verdict, a_lower=boot.a_lower, left_out=left_out)
    if decline is not None:
        return Forecast(
            DECLINING, points, budget, decline.message("the run"), identified, decline,
            verdict=verdict_line("the run", boot, decline), **said,
        )  # fmt: skip
    if boot.on_level:  # no rise: the level's forecast, the same at any budget
        lo, mid, hi = (
            float(np.asarray(v)) for v in boot.predict_ci(budget, observation_noise=True)
        )
        return Forecast(
            LEVEL, points, budget, boot.why_not["a"], identified, at_budget=mid,
            at_budget_ci=(lo, hi), verdict=verdict_line("the run", boot), **said,
        )  # fmt: skip
    if not boot.identifiable:
        return Forecast(
            NOT_IDENTIFIABLE, points, budget, boot.why_not["a"], identified,
            verdict=verdict_line("the run", boot), **said,
        )  # fmt: skip
    # An interval for what an eval at the budget would measure: the curve's uncertainty
    # plus the eval's own noise (the final eval it is checked against carries that noise).
    lo, mid, hi = (
        float(np.asarray(v)) for v in boot.predict_ci(budget, observation_noise=True, seed=seed)
    )
    s = boot.samples  # every resample (fixed shape: no recompile per converged count)
    now = float(compute.max())
    gain_left = np.asarray(s["a"] - sigmoid(now, s["a"], s["b"], s["c_mid"], s["r0"]))
    gain_left = gain_left[np.asarray(boot.converged)]
    gain_left_hi = float(np.quantile(gain_left, 1 - (1 - level) / 2))
    fit = boot.fit
    return Forecast(
        "ok",
        points,
        budget,
        identified=identified,
        a=float(fit.a),
        a_ci=boot.ci["a"],
        b=float(fit.b),
        c_mid=float(fit.c_mid),
        at_budget=mid,
        at_budget_ci=(lo, hi),
        gain_left_hi=gain_left_hi,
        verdict=verdict_line("the run", boot, gain_left=gain_left_hi),
        **said,
    )


class OnlineForecast:
    """Collects (compute, eval pass rate) as a run evaluates and refits on schedule."""

    def __init__(self, cfg: ForecastConfig, total_steps: int, seed: int = 0):
        self.cfg, self.total_steps, self.seed = cfg, total_steps, seed
        self.r0: float | None = None
        self.compute: list[float] = []
        self.rate: list[float] = []
        self.sd: list[float | None] = []  # each eval's sampling sd, when logged
        self.r0_sd: float | None = None
        self.last: Forecast | None = None
        self.first_ok: int | None = None  # evals fitted when the forecast was first "ok"

    def budget(self, step: int) -> float:
        """`forecast.budget`, or the compute the run will have spent at its last step if it
        keeps spending at its rate so far."""
        if self.cfg.budget:
            return self.cfg.budget
        return self.compute[-1] * self.total_steps / max(step, 1)

    def replay(self, curve: Curve) -> None:
        """Take a run's eval curve so far (fit.data.curve_from_rows of its metrics, unclean)
        without refitting (on resume)."""
        self.r0 = curve.r0 if curve.r0 is not None else self.r0
        self.r0_sd = curve.r0_sd if curve.r0 is not None else self.r0_sd
        self.compute += [float(c) for c in curve.compute]
        self.rate += [float(r) for r in curve.reward]
        sds = [None] * curve.compute.size if curve.sd is None else curve.sd.tolist()
        self.sd += sds

    def observe(self, step: int, compute: float, rate: float, sd: float | None = None):
        """Record one evaluation (and its sampling sd, when known); returns forecast fields for
        its metrics row when a refit is due, else None. An evaluation at zero compute (before
        any RL) is R0, as in fit.data.curve_from_rows."""
        if not math.isfinite(rate):
            raise ValueError(f"eval pass rate at step {step} is {rate}")
        sd = None if sd is None or not math.isfinite(sd) else float(sd)
        if compute <= 0:
            self.r0, self.r0_sd = rate, sd
            return None
        self.compute.append(float(compute))
        self.rate.append(float(rate))
        self.sd.append(sd)
        n = len(self.compute)
        if not self.cfg.every or n % self.cfg.every or self.r0 is None:
            return None
        known = all(v is not None for v in self.sd)
        forecast = fit_forecast(
            self.compute,
            self.rate,
            self.r0,
            self.budget(step),
            n_boot=self.cfg.bootstrap,
            level=self.cfg.level,
            method=self.cfg.method,
            seed=self.seed + n,
            min_points=self.cfg.min_points,
            c_min_fraction=self.cfg.c_min_fraction,
            eval_sd=self.sd if known else None,
            r0_sd=self.r0_sd if known else None,
        )
        if forecast.ok and self.first_ok is None:
            self.first_ok = n
        elif not forecast.ok and self.first_ok is not None and forecast.reason:
            # A status that goes back says why, so a reader does not think the run regressed.
            forecast = dataclasses.replace(
                forecast,
                reason=f"A was identified from {self.first_ok} evals on; with {n} it is not: "
                f"{forecast.reason}",
            )
        self.last = forecast
        return forecast.row()

    def should_stop(self) -> str | None:
        """Why the run should stop now (`forecast.stop_when_gain_below`,
        `forecast.stop_when_declining`), or None."""
        threshold, last = self.cfg.stop_when_gain_below, self.last
        if self.cfg.stop_when_declining and last is not None and last.status == DECLINING:
            return f"forecast: {last.reason}; stopping (forecast.stop_when_declining)"
        if not threshold or last is None or not last.ok or last.gain_left_hi >= threshold:
            return None
        return (
            f"forecast: at most {last.gain_left_hi:.3f} pass rate is left to gain (ceiling "
            f"A {last.a:.3f} [{last.a_ci[0]:.3f}, {last.a_ci[1]:.3f}]), below "
            f"forecast.stop_when_gain_below = {threshold}; stopping"
        )
