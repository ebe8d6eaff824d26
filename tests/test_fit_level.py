"""The level model (fit/level.py): runs with no rise get a level, its forecast and a one-sided
ceiling, checked against the binomial standard error by hand and by coverage on simulated
flat runs; rising runs hold none. And the profile's grid reaching below the evals: a run that
rose before its first eval has its ceiling identified from both sides."""

import math
import warnings

import numpy as np
import pytest

from jaxrl_scale.fit import bootstrap_sigmoid, sigmoid
from jaxrl_scale.fit.forecast import LEVEL, fit_forecast
from jaxrl_scale.fit.level import fit_level
from jaxrl_scale.fit.profile import IDENTIFIED, LOWER, NOT_IDENTIFIED
from jaxrl_scale.fit.report import verdict_line

N = 500  # problems in the eval


def _flat(rng, p: float, evals: int, drift: float = 0.0, rho: float = 0.5) -> np.ndarray:
    """Evals of a run that stays at pass rate p: binomial on N problems, plus an AR(1) drift
    of the true rate with marginal sd `drift`."""
    d = np.zeros(evals)
    for t in range(evals):
        prev = d[t - 1] if t else rng.standard_normal() * drift
        d[t] = rho * prev + math.sqrt(1 - rho**2) * drift * rng.standard_normal()
    return rng.binomial(N, np.clip(p + d, 0, 1)) / N


def test_independent_evals_give_their_mean_and_the_binomial_standard_error():
    rng = np.random.default_rng(0)
    y = rng.binomial(N, 0.6, size=40) / N
    level = fit_level(np.arange(1, 41), y, eval_size=N, n=20000)
    se = math.sqrt(y.mean() * (1 - y.mean()) / N / y.size)  # by hand: a mean of 40 evals
    assert level.holds
    assert level.mean == pytest.approx(y.mean(), abs=0.3 * se)
    width = level.interval[1] - level.interval[0]
    # The drift's prior admits a little more than sampling noise: at least the binomial
    # interval, not much wider when 40 evals show no drift.
    assert 2 * 1.96 * se * 0.95 < width < 2 * 1.96 * se * 1.6
    # A new eval carries its own sampling noise: at least +-1.96 binomial sds.
    one = math.sqrt(0.6 * 0.4 / N)
    assert level.predict[1] - level.predict[0] > 2 * 1.96 * one


def test_level_forecasts_cover_flat_runs_and_the_lower_bound_holds():
    """200 flat runs of 8 evals with a drift (sd 0.01, rho 0.5): the level of the first 4
    predicts the last eval within its 95% interval 90-99% of the time, and the ceiling is at
    least the one-sided bound (the true level) in at least 90%."""
    rng = np.random.default_rng(1)
    covered, held, intervals = 0, 0, 0
    for i in range(200):
        p = rng.uniform(0.2, 0.8)
        y = _flat(rng, p, 8, drift=0.01)
        level = fit_level(np.arange(1, 5), y[:4], eval_size=N, seed=i, n=2000)
        if not level.holds:
            continue
        intervals += 1
        covered += level.predict[0] <= y[-1] <= level.predict[1]
        held += level.lower <= p
    assert intervals >= 180  # a flat run shows a trend at about the test's 5%
    assert 0.90 <= covered / intervals <= 0.99
    assert held / intervals >= 0.90


def test_a_rising_run_holds_no_level():
    rng = np.random.default_rng(2)
    c = np.geomspace(1, 100, 8)
    y = rng.binomial(N, 0.3 + 0.1 * np.log10(c)) / N
    level = fit_level(c, y, eval_size=N)
    assert not level.holds and level.trend_p < 0.05
    assert "the evals move" in level.reason and "slope" in level.reason


@pytest.mark.parametrize("held", [True, False], ids=["r0_held", "no_step_0"])
def test_a_flat_run_is_forecast_by_its_level(held):
    """5 evals at one level (a run whose RL does nothing): the sigmoid finds no rise (a curve
    through the noise, its ceiling open on both sides); the level of the evals gives the
    forecast and the fit.json fields. With R0 held at that level, the level bounds nothing
    the model does not (A > R0): not identified, and the line says the run is where it
    started; without a step-0 eval (a distilled model evaluated from step 50 on), the
    ceiling is at least the level's lower bound."""
    rng = np.random.default_rng(4)
    r0, p = 0.304, 0.30
    c = np.array([40.0, 69.0, 100.0, 118.0, 151.0])
    y = rng.binomial(N, p, size=c.size) / N
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        boot = bootstrap_sigmoid(c, y, n=300, r0=r0 if held else None, eval_size=N)
    assert boot.on_level
    lo, mid, hi = (float(v) for v in boot.predict_ci(300.0, observation_noise=True))
    assert (lo, hi) == pytest.approx(boot.flat.predict) and lo < p < hi
    assert mid == pytest.approx(boot.flat.mean)
    d = boot.to_dict()
    assert d["held_level"]["holds"] and d["held_level"]["points"] == c.size  # (R0 not one)
    assert d["level"] == 0.95 and d["held_level"]["level"] == 0.95
    line = verdict_line("run", boot)
    if held:
        assert boot.a_verdict == NOT_IDENTIFIED and boot.a_lower is None
        assert "where it started" in line and "a_lower" not in d
    else:
        assert boot.a_verdict == LOWER and boot.a_lower == boot.flat.lower < p
        assert d["a_verdict"] == LOWER and d["a_lower"] == boot.flat.lower
        assert "no rise" in boot.why_not["a"] and "ceiling is at least" in line


def test_the_online_forecast_of_a_flat_run_says_level():
    rng = np.random.default_rng(5)
    c = np.arange(1.0, 7.0) * 1e12
    y = rng.binomial(N, 0.45, size=c.size) / N
    f = fit_forecast(c, y, 0.45, budget=2e13, n_boot=300, eval_sd=np.full(c.size, 0.0222),
                     r0_sd=0.0222)  # fmt: skip
    assert f.status == LEVEL, f.describe()
    row = f.row()
    assert row["forecast_status"] == "level" and "forecast_a_lower" not in row  # (at R0)
    assert row["forecast_at_budget_lo"] < 0.45 < row["forecast_at_budget_hi"]
    assert "forecast: level" in f.describe() and "where it started" in row["forecast_verdict"]


ROSE_EARLY = dict(a=0.79, b=2.0, r0=0.42)  # and C_mid at or before the first eval


def _rose_early(c_mid: float, seed: int):
    """Evals at 5, 10, ..., 40 of a run whose rise was mostly over by the first (R0 held):
    the evals and their bootstrap."""
    c = np.arange(5.0, 45.0, 5.0)
    y = np.random.default_rng(seed).binomial(N, np.asarray(sigmoid(c, c_mid=c_mid, **ROSE_EARLY)))
    y = y / N
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return y, bootstrap_sigmoid(c, y, n=300, r0=ROSE_EARLY["r0"], eval_size=N)


def test_a_run_that_rose_before_its_first_eval_has_its_ceiling_identified():
    """Evals near the ceiling from the first on (most of the rise came before it, R0 far
    below): the profile looks below the lowest eval too, where ceilings are ruled out, so A
    is identified from both sides and its interval covers the truth. (Its grid started at the
    lowest eval before: a plateau of evals left the lower side open, "not identified".)"""
    y, boot = _rose_early(c_mid=2.0, seed=7)
    assert boot.profile.a.min() < y.min() - 0.05  # the grid reaches below the evals
    assert boot.a_verdict == IDENTIFIED, boot.why_not["a"]
    lo, hi = boot.profile.interval
    assert lo < ROSE_EARLY["a"] < hi


def test_the_figure_draws_a_level_and_its_floor():
    from jaxrl_scale.fit.data import Curve
    from jaxrl_scale.fit.plot import draw_fits

    rng = np.random.default_rng(4)
    c = np.array([40.0, 69.0, 100.0, 118.0, 151.0])
    y = rng.binomial(N, 0.3, size=c.size) / N
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        boot = bootstrap_sigmoid(c, y, n=300, eval_size=N)  # no step 0: the level bounds A
    fig = draw_fits([(Curve("flat", c, y), boot, None)])
    ax = fig.axes[-1]
    label = ax.get_legend().get_texts()[0].get_text()
    assert label == f"flat: A >= {boot.a_lower:.3f} (one-sided, 95%), level {boot.flat.mean:.3f}"
    drawn = [ln for ln in ax.get_lines() if len(ln.get_ydata()) > 2]  # the model's line
    assert np.allclose(np.concatenate([ln.get_ydata() for ln in drawn]), boot.flat.mean)


def test_a_ceiling_the_profile_pins_down_keeps_its_interval_when_refits_of_the_rise_fail():
    """A rise before the first eval (C_mid at 1, evals from 5): about a fifth of the refits
    fail, B and C_mid running off, which used to cost A its verdict. A is identified, its
    interval the envelope of the converged refits' and the profile's, and it covers."""
    _, boot = _rose_early(c_mid=1.0, seed=8)
    assert 0.5 <= boot.converged_fraction < 0.9 and boot.profile.verdict == IDENTIFIED
    assert boot.a_verdict == IDENTIFIED and boot.identified == {"a": True, "b": False,
                                                                "c_mid": False}  # fmt: skip
    lo, hi = boot.ci["a"]
    assert lo <= boot.profile.interval[0] and boot.profile.interval[1] <= hi
    assert lo < ROSE_EARLY["a"] < hi


def test_jaxrl_scale_fit_ranks_a_level_run_by_its_level(tmp_path, capsys):
    """`jaxrl-scale fit --json` on a flat run (five 500-problem evals at 0.5, no step 0;
    its sigmoid draws a ceiling of 0.84 through the noise) and one climbing to 0.6: the flat
    run carries `held_level`, is ranked (not "did not converge") and ranks by its level,
    below the climbing run; no shared ceiling is fitted with it."""
    import json

    from jaxrl_scale.cli import main

    c = np.geomspace(300, 30000, 5)
    flat = np.random.default_rng(5).binomial(N, 0.5, size=5) / N
    climbing = np.asarray(sigmoid(np.geomspace(300, 30000, 12), 0.6, 1.9, 2000.0, 0.3))
    for name, xs, ys in (("flat", c, flat), ("climbing", np.geomspace(300, 30000, 12), climbing)):
        rows = ["compute,pass_rate", *(f"{x},{y}" for x, y in zip(xs, ys, strict=True))]
        (tmp_path / f"{name}.csv").write_text("\n".join(rows) + "\n")
    args = ["fit", str(tmp_path / "flat.csv"), str(tmp_path / "climbing.csv"), "--x", "compute",
            "--y", "pass_rate", "--bootstrap", "300", "--json"]  # fmt: skip
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    run = {r["run"]: r for r in report["runs"]}["flat"]
    assert run["held_level"]["holds"] and run["a"] > 0.7 and run["held_level"]["mean"] < 0.55
    assert report["ranking"] == ["climbing", "flat"] and report["shared_ceiling"] == []
    assert "no rise" in run["verdict"]
