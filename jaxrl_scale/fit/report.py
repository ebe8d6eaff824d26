"""What `jaxrl-scale fit` computes and prints: fits with intervals, forecasts, comparison."""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_scale.fit.bootstrap import BootstrapResult, bootstrap_sigmoid
from jaxrl_scale.fit.comparison import shared_ceiling
from jaxrl_scale.fit.data import (
    Curve,
    CurveDataError,
    CurveDataWarning,
    curve_from_rows,
    load_curve,
)
from jaxrl_scale.fit.decline import Decline, detect_decline
from jaxrl_scale.fit.extrapolation import ExtrapolationReport, early_cut, extrapolation_check
from jaxrl_scale.fit.profile import IDENTIFIED, LOWER

NAMES = {"a": "A", "b": "B", "c_mid": "C_mid"}


def identified_label(identified: dict[str, bool]) -> str:
    """'A, B, C_mid' / 'A' / 'none': which parameters the data pin down."""
    names = [NAMES[k] for k in ("a", "b", "c_mid") if identified.get(k)]
    return ", ".join(names) or "none"


def verdict_line(name: str, boot: BootstrapResult, decline: Decline | None = None, *,
                 gain_left: float | None = None) -> str:  # fmt: skip
    """One line a person can act on: where the run stands against its ceiling, and what more
    compute buys. `gain_left`: the upper end of A minus the fitted rate now, when known."""
    if decline is not None:
        return (f"{name}: past its peak ({decline.peak:.3f}, now {decline.last:.3f}): more "
                "compute on this recipe loses reward; keep the best checkpoint")  # fmt: skip
    verdict, level = boot.a_verdict, f"{boot.level:.0%}"
    if verdict == IDENTIFIED:
        a, (lo, hi) = float(boot.fit.a), boot.ci["a"]
        if gain_left is None:
            gain_left = boot.gain_left()
        if gain_left <= 0.01:
            return (f"{name}: within 0.01 of its ceiling ({a:.3f}): more compute buys "
                    "little")  # fmt: skip
        return (f"{name}: ceiling {a:.3f} [{lo:.3f}, {hi:.3f}] at {level}, up to "
                f"{gain_left:.3f} above where it is now: more compute still pays")  # fmt: skip
    if boot.on_level:
        flat = boot.flat
        held = f"{name}: holds {flat.mean:.3f} [{flat.interval[0]:.3f}, {flat.interval[1]:.3f}]"
        if not boot.level_bounds_a:
            return (f"{held}, at or below where it started (R0 {float(boot.fit.r0):.3f}), with "
                    "no rise: "
                    "more compute on this recipe has bought nothing so far")  # fmt: skip
        return (f"{held} with no rise, so its ceiling is at least {flat.lower:.3f} ({level}); "
                "more compute on this recipe has bought nothing so far")  # fmt: skip
    if verdict == LOWER:
        return (f"{name}: ceiling at least {boot.a_lower:.3f} ({level}); the run is still "
                "climbing: train on (nothing bounds the ceiling from above yet)")  # fmt: skip
    return (f"{name}: no ceiling to read yet: the evals do not rise clearly above their "
            "noise; train on, or evaluate on more problems")  # fmt: skip


def fit_warnings(boot: BootstrapResult, decline: Decline | None, name: str) -> list[str]:
    """What a reader of a fit must know: a decline, and each parameter the data do not pin
    down with the true reason."""
    out = [] if decline is None else [decline.message(name)]
    why = boot.why_not
    if why["a"] is not None:
        out.append(f"{name}: A is not identified ({why['a']}); read its interval, not its value")
    if why["b"] is not None and why["b"] != why["a"]:
        out.append(f"{name}: B and C_mid are not identified ({why['b']})")
    elif why["b"] is not None:
        out.append(f"{name}: B and C_mid are not identified either")
    return out


def run_curve(rows: list[dict[str, Any]], x: str = "compute_flops", name: str = "run") -> Curve:
    """A finished run's eval curve (fit.data.curve_from_rows), which must have its R0."""
    curve = curve_from_rows(rows, x=x, name=name)
    if curve.r0 is None:
        raise CurveDataError(f"{name}: the run has no evaluation before RL (R0)")
    return curve


@dataclasses.dataclass(frozen=True)
class RunFit:
    """A finished run's curve: the fit to all of it and the fit to its first half."""

    r0: float
    compute: np.ndarray
    rate: np.ndarray
    final: BootstrapResult
    half: ExtrapolationReport | None  # None when the first half has too few points
    decline: Decline | None = None

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            **self.final.to_dict(),
            "final_pass_rate": float(self.rate[-1]),
            "gain": float(self.rate[-1] - self.r0),
            "declining": None if self.decline is None else self.decline.to_dict(),
            "warnings": fit_warnings(self.final, self.decline, "run"),
            "verdict": verdict_line("run", self.final, self.decline),
            "half_run": None,
        }
        h = self.half
        if h is not None:
            out["half_run"] = {
                "points_fitted": h.n_fit,
                "c_cut": h.c_cut,
                "a": float(h.boot.fit.a),
                "a_ci": list(h.boot.ci["a"]),
                "identifiable": h.boot.identifiable,
                "identified": h.boot.identified,
                "predicted_final": h.predicted,
                "interval": [h.lo, h.hi],
                "actual_final": h.actual,
                "error": h.error,
                "covered": h.covered,
            }
        return out


def fit_run(rows: list[dict[str, Any]], *, x: str = "compute_flops", n_boot: int = 2000):
    """Fit a run's eval curve (R0 held at the step-0 eval; the sampling noise its logged
    `eval_sampling_sd` gives), check the forecast its first half makes of its last point (the
    paper's protocol) and test it for a decline."""
    curve = run_curve(rows, x)
    r0, compute, rate = curve.r0, curve.compute, curve.reward
    noise = dict(eval_sd=curve.sd, r0_sd=curve.r0_sd)
    final = bootstrap_sigmoid(compute, rate, n=n_boot, r0=r0, **noise)
    try:
        half = extrapolation_check(compute, rate, fit_until=0.5, n_boot=n_boot, r0=r0, **noise)
    except CurveDataError:
        half = None
    return RunFit(r0, compute, rate, final, half, detect_decline(curve, r0=r0))


def _drop_early(curve: Curve, fraction: float) -> Curve:
    cut = early_cut(curve.compute, fraction)
    keep = curve.compute >= cut
    if keep.all():
        return curve
    warnings.warn(
        f"{curve.name}: left out {int((~keep).sum())} early points with compute < {cut:.4g} "
        f"({fraction} of the last)",
        CurveDataWarning,
        stacklevel=3,
    )
    steps = None if curve.steps is None else curve.steps[keep]
    sd = None if curve.sd is None else curve.sd[keep]
    return dataclasses.replace(
        curve, compute=curve.compute[keep], reward=curve.reward[keep], steps=steps, sd=sd
    )


def _run_entry(
    curve: Curve, boot, predict_at: float | None, extrapolation=None, decline=None
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "run": curve.name,
        "points": int(curve.compute.size),
        **boot.to_dict(),
        "declining": None if decline is None else decline.to_dict(),
        "warnings": fit_warnings(boot, decline, curve.name),
        "verdict": verdict_line(curve.name, boot, decline),
    }
    if predict_at is not None:
        lo, mid, hi = (float(np.asarray(v)) for v in boot.predict_ci(predict_at))
        entry.update(predict_at=predict_at, predicted=mid, predicted_ci=[lo, hi])
    if extrapolation is not None:
        entry["extrapolation"] = {
            "c_cut": extrapolation.c_cut,
            "points_fitted": extrapolation.n_fit,
            "c_last": extrapolation.c_last,
            "actual": extrapolation.actual,
            "predicted": extrapolation.predicted,
            "interval": [extrapolation.lo, extrapolation.hi],
            "error": extrapolation.error,
            "covered": extrapolation.covered,
        }
    return entry


def fit_files(
    paths: list[str | Path],
    *,
    x: str = "compute_flops",
    y: str = "eval_pass_rate",
    r0: float | None = None,
    c_min: float | None = None,
    c_min_fraction: float = 0.0,
    fit_until: float | None = None,
    predict_at: float | None = None,
    n_boot: int = 2000,
    a_max: float = 1.0,
    margin: float = 0.02,
    seed: int = 0,
    plot: str | Path | None = None,
    eval_size: int | None = None,
) -> dict[str, Any]:
    """Fit every file's curve and compare them; returns the JSON-ready report. R0 is held at
    `r0` when given, else at a file's own zero-compute measurement (a run's step-0 eval), else
    fitted. Points below `c_min` (compute units) are dropped on loading; points below
    `c_min_fraction` of the last fitted compute are left out of each fit (early transients).
    The eval noise's sampling part is known from `eval_size` (binomial) or from a file's
    `eval_sampling_sd` column; each run is tested for a decline, and declining runs are
    named instead of ranked."""
    curves = [load_curve(p, x=x, y=y, a_max=a_max, c_min=c_min) for p in paths]
    if c_min_fraction and fit_until is None:  # with fit_until, the cut is of the fitted part
        curves = [_drop_early(c, c_min_fraction) for c in curves]
    names = [c.name for c in curves]
    if len(set(names)) != len(names):  # two runs/metrics.jsonl: name them by their path
        curves = [dataclasses.replace(c, name=str(p)) for p, c in zip(paths, curves, strict=True)]
    runs, plotted, fitted = [], [], []
    held_r0 = r0
    for curve in curves:
        r0 = held_r0 if held_r0 is not None else curve.r0
        sizes = curve.sd is None and eval_size is not None  # a logged sd is per eval: finer
        noise = dict(
            eval_size=eval_size if sizes else None,
            eval_sd=curve.sd,
            r0_sd=curve.r0_sd if held_r0 is None else None,
        )
        extrapolation, c_cut = None, None
        if fit_until is not None:
            extrapolation = extrapolation_check(
                curve.compute,
                curve.reward,
                fit_until=fit_until,
                n_boot=n_boot,
                seed=seed,
                r0=r0,
                a_max=a_max,
                c_min_fraction=c_min_fraction,
                **noise,
            )
            boot, c_cut = extrapolation.boot, extrapolation.c_cut
            keep = curve.compute <= c_cut
            fitted.append(Curve(curve.name, curve.compute[keep], curve.reward[keep], r0=r0))
        else:
            boot = bootstrap_sigmoid(
                curve.compute, curve.reward, n=n_boot, seed=seed, r0=r0, a_max=a_max, **noise
            )
            fitted.append(dataclasses.replace(curve, r0=r0))
        decline = detect_decline(curve, r0=r0, eval_size=noise["eval_size"], seed=seed)
        runs.append(_run_entry(curve, boot, predict_at, extrapolation, decline))
        plotted.append((curve, boot, c_cut))
    for e in runs:
        if not _fitted(e) and not _level(e):
            e["warnings"].append(
                f"{e['run']}: the fit did not converge (A [{_fmt(e['a_ci'][0])}, "
                f"{_fmt(e['a_ci'][1])}]), so it is neither ranked nor compared; more "
                "evaluations over more compute would help (train.eval_every, more steps)"
            )
    # A run that holds a level ranks by it (its sigmoid, if any, is a curve through noise).
    ceiling = lambda e: e["held_level"]["mean"] if _level(e) else e["a"]  # noqa: E731
    ranking = sorted(
        (e for e in runs if e["declining"] is None and (_fitted(e) or _level(e))),
        key=lambda e: -ceiling(e),
    )
    shared = []
    for i, first in enumerate(ranking):
        for second in ranking[i + 1 :]:
            if _level(first) or _level(second):  # a level has no ceiling to share
                continue
            if abs(first["a"] - second["a"]) < margin:
                by_name = {c.name: c for c in fitted}
                s = shared_ceiling(
                    by_name[first["run"]], by_name[second["run"]], a_max=a_max, n_boot=n_boot
                )
                shared.append(shared_entry(s))
    report = {
        "x": x,
        "y": y,
        "runs": runs,
        "ranking": [e["run"] for e in ranking],
        "declining": [e["run"] for e in runs if e["declining"] is not None],
        "not_converged": [e["run"] for e in runs if not _fitted(e) and not _level(e)],
        "eval_size": eval_size,
        "margin": margin,
        "shared_ceiling": shared,
    }
    if plot is not None:
        from jaxrl_scale.fit.plot import plot_fits

        report["plot"] = str(plot_fits(plotted, plot, predict_at=predict_at, xlabel=x, ylabel=y))
    return report


def _level(entry: dict[str, Any]) -> bool:
    """Whether a run's evals hold a level with no rise (fit/level.py)."""
    return bool(entry.get("held_level", {}).get("holds"))


def _fitted(entry: dict[str, Any]) -> bool:
    """Whether a run's fit converged, with a finite A and interval: only those are ranked."""
    return bool(entry["converged"]) and all(math.isfinite(v) for v in (entry["a"], *entry["a_ci"]))


def shared_entry(s) -> dict[str, Any]:
    """A SharedCeiling as JSON (the fit report and the sweep)."""
    return {
        "runs": list(s.runs),
        "a": s.a,
        "b": list(s.b),
        "c_mid": list(s.c_mid),
        "b_diff_ci": list(s.b_diff_ci),
        "more_efficient": s.more_efficient,
        "verdict": s.verdict,
    }


def describe_shared(s: dict[str, Any], margin: float) -> str:
    """One line for a shared-A comparison."""
    first, second = s["runs"]
    lo, hi = s["b_diff_ci"]
    verdict = (
        f"{s['verdict']} is more compute-efficient"
        if s["verdict"] != "indistinguishable"
        else "indistinguishable (the interval covers 0)"
    )
    return (
        f"{first} and {second}: A within {margin}; with a shared A = {s['a']:.3f}, B = "
        f"{s['b'][0]:.3f} vs {s['b'][1]:.3f}, B difference [{lo:+.3f}, {hi:+.3f}] -> {verdict}"
    )


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return "nan"
    return f"{v:.4g}" if abs(v) >= 1e4 or abs(v) < 1e-3 else f"{v:.3f}"


def format_report(report: dict[str, Any]) -> str:
    """The human-readable table."""
    header = ["run", "A [lo, hi]", "B", "C_mid", "R0", "identified"]
    has_pred = any("predicted" in r for r in report["runs"])
    has_extra = any("extrapolation" in r for r in report["runs"])
    if has_pred:
        header.append(f"R({_fmt(report['runs'][0]['predict_at'])}) [lo, hi]")
    if has_extra:
        header.append("last point: actual / predicted, covered")
    header.append("converged")
    rows = [header]
    for r in report["runs"]:
        a_cell = f"{r['a']:.3f} [{r['a_ci'][0]:.3f}, {r['a_ci'][1]:.3f}]"
        if r.get("a_lower") is not None:  # bounded below only: the bound, not an interval
            a_cell = f">= {r['a_lower']:.3f} (one-sided)"
        row = [
            r["run"],
            a_cell,
            _fmt(r["b"]),
            _fmt(r["c_mid"]),
            _fmt(r["r0"]),
            identified_label(r["identified"]),
        ]
        if has_pred:
            lo, hi = r["predicted_ci"]
            row.append(f"{r['predicted']:.3f} [{lo:.3f}, {hi:.3f}]")
        if has_extra:
            e = r["extrapolation"]
            row.append(
                f"{e['actual']:.3f} / {e['predicted']:.3f}, {'yes' if e['covered'] else 'no'}"
            )
        row.append("yes" if r["converged"] else "NO")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    for r in report["runs"]:
        lines += [f"warning: {w}" for w in r["warnings"]]
    if len(report["runs"]) > 1:
        lines.append("ranking by A: " + (" > ".join(report["ranking"]) or "(none)"))
    if report["declining"]:
        lines.append("declining, not ranked: " + ", ".join(report["declining"]))
    if report.get("not_converged"):
        lines.append("not converged, not ranked: " + ", ".join(report["not_converged"]))
    for s in report["shared_ceiling"]:
        lines.append(describe_shared(s, report["margin"]))
    if "plot" in report:
        lines.append(f"plot: {report['plot']}")
    lines += [f"verdict: {r['verdict']}" for r in report["runs"] if "verdict" in r]
    return "\n".join(lines)
