"""A's verdict from its profile likelihood (fit/profile.py), the one-sided bound, the one-line
verdicts, and the solver's early stop; checked against scipy's fits with A held."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.optimize import curve_fit

from jaxrl_scale.fit import bootstrap_sigmoid, fit_sigmoid, sigmoid
from jaxrl_scale.fit.forecast import fit_forecast
from jaxrl_scale.fit.profile import IDENTIFIED, LOWER, NOT_IDENTIFIED, profile_a
from jaxrl_scale.fit.report import format_report
from jaxrl_scale.fit.sigmoid_fit import FitSpec, fit_batch

C = np.geomspace(100, 20000, 24)
R0 = 0.30
PLATEAU = dict(a=0.61, b=1.5, c_mid=340.0, r0=R0)  # levelled off early in the data
EARLY = dict(a=0.7, b=1.2, c_mid=3e4, r0=R0)  # the data stop before the inflection


def _noisy(truth, seed=1, sd=0.015):
    rng = np.random.default_rng(seed)
    return np.clip(np.asarray(sigmoid(C, **truth)) + sd * rng.standard_normal(C.size), 0, 1)


def _boot(y, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bootstrap_sigmoid(C, y, n=300, r0=R0, **kw)


def test_the_profile_is_scipys_least_squares_with_a_held():
    """D(A) with unit noise is SSE(A) - SSE_min; scipy refits B and C_mid with each A held
    (R0 held too) and must find the same sums of squares."""
    y = _noisy(PLATEAU)
    spec = FitSpec(fit_r0=False)
    with jax.enable_x64(True):
        log_c, yy, w = jnp.log(jnp.asarray(C)), jnp.asarray(y), jnp.ones(C.size)
        point = jax.tree.map(lambda v: v[0], fit_batch(
            log_c, yy[None], w[None], jnp.full((1,), R0), jnp.zeros(1), spec=spec))  # fmt: skip
        prof = profile_a(log_c, yy, w, point, spec, noise_var=1.0, held_r0=R0)

    def sse(a):
        f = lambda c, b, cm: R0 + (a - R0) / (1 + (cm / c) ** b)  # noqa: E731
        best = np.inf
        for start in (300.0, 1000.0, 3000.0):
            try:
                p, _ = curve_fit(f, C, y, p0=[1.5, start], maxfev=20000)
            except RuntimeError:
                continue
            best = min(best, float(np.sum((f(C, *p) - y) ** 2)))
        return best

    f_all = lambda c, a, b, cm: R0 + (a - R0) / (1 + (cm / c) ** b)  # noqa: E731
    p, _ = curve_fit(f_all, C, y, p0=[0.6, 1.5, 400.0], maxfev=20000)
    sse_min = float(np.sum((f_all(C, *p) - y) ** 2))
    best = int(np.nanargmin(prof.deviance))  # (NaN: a held fit that did not converge)
    for i in (best - 6, best - 3, best + 3, best + 6):
        assert prof.deviance[i] == pytest.approx(sse(prof.a[i]) - sse_min, rel=1e-3, abs=1e-7)


def test_a_run_that_levelled_off_is_identified_and_its_interval_covers_the_truth():
    boot = _boot(_noisy(PLATEAU))
    assert boot.a_verdict == IDENTIFIED and boot.identifiable and boot.a_lower is None
    lo, hi = boot.profile.interval
    assert lo < PLATEAU["a"] < hi and hi - lo < 0.06
    assert boot.ci["a"][0] < PLATEAU["a"] < boot.ci["a"][1]  # the bootstrap's interval
    assert boot.to_dict()["a_verdict"] == IDENTIFIED and "a_lower" not in boot.to_dict()


def test_a_run_still_climbing_gets_a_one_sided_ceiling():
    """Before the inflection no ceiling above the data can be ruled out: A >= a_lower, below
    the truth and above where the run started; the table and the verdict say so."""
    boot = _boot(_noisy(EARLY))
    assert boot.a_verdict == LOWER and not boot.identifiable
    assert R0 < boot.a_lower < EARLY["a"]
    assert "rule out a lower ceiling, not a higher one" in boot.why_not["a"]
    d = boot.to_dict()
    assert d["a_verdict"] == LOWER and d["a_lower"] == pytest.approx(boot.a_lower)
    assert d["identified"]["a"] is False
    report = {"runs": [{"run": "r", "points": C.size, **d, "warnings": [],
                        "verdict": "r: ceiling at least"}], "ranking": [], "declining": [],
              "shared_ceiling": [], "margin": 0.02}  # fmt: skip
    text = format_report(report)
    assert f">= {boot.a_lower:.3f} (one-sided)" in text and "verdict: r: ceiling at least" in text


def test_evals_that_do_not_rise_identify_nothing():
    flat = np.clip(R0 + 0.015 * np.random.default_rng(3).standard_normal(C.size), 0, 1)
    boot = _boot(flat)
    assert boot.a_verdict == NOT_IDENTIFIED and boot.a_lower is None
    # They hold a level (fit/level.py) at R0, which bounds nothing the model does not.
    assert boot.on_level and "no rise to read a ceiling from" in boot.why_not["a"]


def test_one_sided_bounds_cover_the_truth():
    """Over 30 noisy runs stopping before the inflection, most are bounded below only, and
    what the verdicts claim holds: A >= a_lower, or A inside the interval where a run's data
    happen to identify it (95%: at most 4 misses of 30 is within sampling of 5%)."""
    misses, bounded = 0, 0
    for seed in range(30):
        boot = _boot(_noisy(EARLY, seed=100 + seed), seed=seed)
        if boot.a_verdict == LOWER:
            bounded += 1
            misses += boot.a_lower > EARLY["a"]
        elif boot.a_verdict == IDENTIFIED:
            misses += not boot.ci["a"][0] <= EARLY["a"] <= boot.ci["a"][1]
    assert bounded >= 20 and misses <= 4


@pytest.mark.parametrize(
    ("truth", "words"),
    [(PLATEAU, "more compute buys little"), (EARLY, "ceiling at least")],
)
def test_the_forecast_ends_with_a_line_to_act_on(truth, words):
    f = fit_forecast(C, _noisy(truth), R0, budget=float(C[-1]) * 2, n_boot=300)
    row = f.row()
    assert words in row["forecast_verdict"] and row["forecast_verdict"] in f.describe()
    assert row["forecast_a_verdict"] == (IDENTIFIED if truth is PLATEAU else LOWER)
    assert ("forecast_a_lower" in row) == (truth is EARLY)


def test_the_solver_stops_early_at_the_same_fits():
    """Stopping each block once its lanes are stationary gives the fits all 40 iterations
    give (float32, bootstrap weights)."""
    rng = np.random.default_rng(0)
    y = np.broadcast_to(_noisy(PLATEAU), (256, C.size)).astype(np.float32)
    counts = rng.multinomial(C.size, np.full(C.size, 1 / C.size), size=256).astype(np.float32)
    args = (jnp.log(jnp.asarray(C, jnp.float32)), jnp.asarray(y), jnp.asarray(counts),
            jnp.zeros(256), jnp.zeros(256))  # fmt: skip
    early = fit_batch(*args, spec=FitSpec())
    full = fit_batch(*args, spec=FitSpec(settle=None))
    both = np.asarray(early.converged) & np.asarray(full.converged)
    assert np.array_equal(np.asarray(early.converged), np.asarray(full.converged))
    assert both.mean() > 0.85
    assert np.max(np.abs(np.asarray(early.a) - np.asarray(full.a))[both]) < 2e-3
    assert np.median(np.abs(np.asarray(early.a) - np.asarray(full.a))[both]) < 1e-4
    one = fit_sigmoid(C, _noisy(PLATEAU))
    assert bool(one.converged)


def test_the_figure_draws_a_one_sided_ceiling_as_a_floor():
    from jaxrl_scale.fit.data import Curve
    from jaxrl_scale.fit.plot import draw_fits

    early, plateau = _boot(_noisy(EARLY)), _boot(_noisy(PLATEAU))
    fig = draw_fits([(Curve("early", C, _noisy(EARLY)), early, None),
                     (Curve("plateau", C, _noisy(PLATEAU)), plateau, None)])  # fmt: skip
    ax = fig.axes[-1]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[0] == f"early: A >= {early.a_lower:.3f} (one-sided, 95%)"
    assert labels[1].startswith("plateau: A=")  # an interval, where identified
    floors = [ln for ln in ax.get_lines() if list(ln.get_ydata()) == [early.a_lower] * 2]
    assert len(floors) == 1


def test_fit_json_carries_the_one_sided_bound_and_the_verdict_line(tmp_path, capsys):
    import json

    from jaxrl_scale.cli import main

    rows = ["compute,pass_rate", f"0,{R0}"]
    rows += [f"{c},{r}" for c, r in zip(C, _noisy(EARLY), strict=True)]
    (tmp_path / "early.csv").write_text("\n".join(rows) + "\n")
    args = ["fit", str(tmp_path / "early.csv"), "--x", "compute", "--y", "pass_rate",
            "--bootstrap", "300", "--eval-n", "1319"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["identified"]["a"] is False and run["a_verdict"] == LOWER
    assert R0 < run["a_lower"] < EARLY["a"] and "ceiling at least" in run["verdict"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert text.rstrip().splitlines()[-1].startswith("verdict: early: ceiling at least")
