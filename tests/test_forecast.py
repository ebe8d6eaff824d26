"""The online forecast on synthetic eval streams drawn from a known sigmoid."""

import numpy as np
import pytest

from jaxrl_scale.config import ConfigError, ForecastConfig
from jaxrl_scale.fit.data import curve_from_rows
from jaxrl_scale.fit.forecast import LEVEL, NOT_IDENTIFIABLE, OnlineForecast, fit_forecast

A, B, C_MID, R0 = 0.72, 1.6, 1e12, 0.30


def _curve(c):
    return R0 + (A - R0) / (1 + (C_MID / c) ** B)


def _stream(seed=0, n=24, noise=0.01):
    """Evenly spaced steps; compute grows linearly with the step, like a run's."""
    rng = np.random.default_rng(seed)
    compute = np.linspace(1, n, n) * C_MID / 4  # the inflection is at point 4 of n
    rate = np.clip(_curve(compute) + noise * rng.normal(size=n), 0, 1)
    return compute, rate


def test_not_identifiable_before_the_inflection_then_converges_to_the_true_ceiling():
    cfg = ForecastConfig(every=1, bootstrap=200, min_points=4)
    compute = np.geomspace(C_MID / 60, C_MID * 40, 20)
    rate = _curve(compute) + 0.006 * np.random.default_rng(1).normal(size=compute.size)
    forecaster = OnlineForecast(cfg, total_steps=20)
    assert forecaster.observe(0, 0.0, R0) is None  # R0, not a point
    statuses = []
    for step, (c, r) in enumerate(zip(compute, rate, strict=True), start=1):
        fields = forecaster.observe(step, c, r)
        statuses.append((c, fields["forecast_status"], fields))
    # The first three evaluations are too few; the concave start cannot pin A. Its first
    # evals rise 0.005 in noise of 0.006: they hold a level (R0's) as far as they show, which
    # bounds nothing, or are a start no ceiling can be read from.
    assert [s for _, s, _ in statuses[:3]] == ["too few points"] * 3
    early = [(s, f) for c, s, f in statuses[3:] if c < C_MID / 4]
    assert early and all(s in (NOT_IDENTIFIABLE, LEVEL) for s, _ in early)
    assert all("forecast_a" not in f and "forecast_a_lower" not in f for _, f in early)
    # Well past the inflection the forecast is identifiable and covers the true ceiling.
    late = [f for c, _, f in statuses if c > 8 * C_MID]
    # A refit whose solver stops short of a stationary point says so and gives no numbers.
    # Which eval that happens at depends on float bits (compiled at XLA's level 0, the refit
    # on 9 of 18 points stops short): at most one here, never the last, never a wrong ceiling.
    missed = [f for f in late if f["forecast_status"] != "ok"]
    assert all("the fit did not converge" in f["forecast_reason"] for f in missed)
    assert late and len(missed) <= 1 and late[-1]["forecast_status"] == "ok"
    final = late[-1]
    assert final["forecast_a_lo"] <= A <= final["forecast_a_hi"]
    assert final["forecast_a_hi"] - final["forecast_a_lo"] < 0.05
    assert abs(final["forecast_a"] - A) < 0.02
    # The budget defaults to the run's projected end: the last eval is the last step here.
    assert final["forecast_budget"] == pytest.approx(compute[-1])
    lo, hi = final["forecast_at_budget_lo"], final["forecast_at_budget_hi"]
    assert lo <= _curve(compute[-1]) <= hi


def test_budget_is_projected_from_the_spend_so_far_unless_configured():
    compute, rate = _stream()
    forecaster = OnlineForecast(ForecastConfig(every=1, bootstrap=200), total_steps=100)
    forecaster.observe(0, 0.0, R0)
    for step in range(1, 7):  # 6 evals at steps 1..6, compute = step * C_MID / 4
        fields = forecaster.observe(step, compute[step - 1], rate[step - 1])
    assert fields["forecast_budget"] == pytest.approx(100 * C_MID / 4)
    fixed = OnlineForecast(ForecastConfig(every=1, budget=5e13, bootstrap=200), total_steps=100)
    fixed.observe(0, 0.0, R0)
    for step in range(1, 7):
        fields = fixed.observe(step, compute[step - 1], rate[step - 1])
    assert fields["forecast_budget"] == 5e13


def test_refits_every_m_evaluations_only():
    compute, rate = _stream()
    forecaster = OnlineForecast(ForecastConfig(every=3, bootstrap=200), total_steps=24)
    forecaster.observe(0, 0.0, R0)
    due = [
        forecaster.observe(i + 1, c, r) is not None
        for i, (c, r) in enumerate(zip(compute, rate, strict=True))
    ]
    assert due == [(i + 1) % 3 == 0 for i in range(len(compute))]


def test_stop_when_the_remaining_gain_is_small():
    compute, rate = _stream(n=40)
    cfg = ForecastConfig(every=1, bootstrap=200, stop_when_gain_below=0.03)
    forecaster = OnlineForecast(cfg, total_steps=40)
    forecaster.observe(0, 0.0, R0)
    stopped_at = None
    for step, (c, r) in enumerate(zip(compute, rate, strict=True), start=1):
        forecaster.observe(step, c, r)
        if forecaster.should_stop():
            stopped_at = step
            break
    assert stopped_at is not None
    # True remaining gain where it stopped is small; at the inflection it was half the span.
    assert A - _curve(compute[stopped_at - 1]) < 0.05
    assert stopped_at > 4
    message = forecaster.should_stop()
    assert "forecast.stop_when_gain_below" in message and "stopping" in message
    # Without the option nothing stops, not even on the forecast that stopped the run above
    # (the same evaluations up to there, refitted alike).
    never = OnlineForecast(ForecastConfig(every=1, bootstrap=200), total_steps=40)
    never.observe(0, 0.0, R0)
    seen = zip(compute[:stopped_at], rate[:stopped_at], strict=True)
    for step, (c, r) in enumerate(seen, start=1):
        never.observe(step, c, r)
    assert never.last == forecaster.last
    assert never.should_stop() is None


def test_replay_restores_history_without_refitting():
    compute, rate = _stream(n=8)
    rows = [{"step": 0, "compute_flops": 0.0, "eval_pass_rate": R0}, {"step": 1, "loss": 0.1}]
    rows += [
        {"step": i + 2, "compute_flops": c, "eval_pass_rate": r}
        for i, (c, r) in enumerate(zip(compute, rate, strict=True))
    ]
    forecaster = OnlineForecast(ForecastConfig(every=1, bootstrap=100), total_steps=8)
    forecaster.replay(curve_from_rows(rows[:4], clean=False))  # 2 points: fewer than a fit needs
    assert forecaster.r0 == R0 and forecaster.compute == list(compute[:2])
    assert forecaster.last is None
    # The same rule for R0 as every other reader: rows at zero compute measure it.
    assert curve_from_rows(rows).r0 == R0 and curve_from_rows(rows).steps.tolist() == [
        2,
        3,
        4,
        5,
        6,
        7,
        8,
        9,
    ]


def test_observe_takes_any_zero_compute_evaluation_as_r0():
    forecaster = OnlineForecast(ForecastConfig(every=1, bootstrap=100), total_steps=8)
    assert forecaster.observe(3, 0.0, 0.25) is None  # no RL compute yet: R0, not a point
    assert forecaster.r0 == 0.25 and forecaster.compute == []


def test_bad_input():
    forecaster = OnlineForecast(ForecastConfig(), total_steps=10)
    with pytest.raises(ValueError, match="step 3"):
        forecaster.observe(3, 1e9, float("nan"))
    with pytest.raises(ConfigError, match="forecast.min_points"):
        ForecastConfig(min_points=2)
    with pytest.raises(ConfigError, match="forecast.level"):
        ForecastConfig(level=1.5)
    # A rate outside [0, 1] is a fit failure the row reports, not a crash of the run.
    result = fit_forecast([1, 2, 3, 4, 5], [0.1, 0.2, 1.5, 0.3, 0.4], 0.1, 10.0, n_boot=20)
    assert result.status.startswith("fit failed") and "reward[2]" in result.status


def test_early_cut_by_hand():
    from jaxrl_scale.fit.extrapolation import early_cut

    c = np.arange(1.0, 11.0)  # 1 ... 10
    assert early_cut(c, 0.0) == 0.0  # off
    assert early_cut(c, 0.25) == 2.5  # 0.25 x 10: points 1 and 2 go
    assert early_cut(c, 0.9) == 7.0  # 9 would leave 2 points; never fewer than 4
    assert early_cut(c[:4], 0.5) == 0.0  # 4 points: nothing to spare
    with pytest.raises(ValueError, match="c_min_fraction"):
        early_cut(c, 1.0)
    with pytest.raises(ConfigError, match="forecast.c_min_fraction"):
        ForecastConfig(c_min_fraction=-0.1)


def test_the_forecast_leaves_out_early_evals_below_the_cut():
    compute, rate = _stream(n=24)
    kept = compute >= 0.2 * compute[-1]
    cut = fit_forecast(compute, rate, R0, 1e13, n_boot=200, c_min_fraction=0.2)
    assert cut.points == int(kept.sum()) < compute.size
    assert cut.row()["forecast_left_out"] == compute.size - cut.points  # counted in the row
    # The same as fitting the late points alone.
    alone = fit_forecast(compute[kept], rate[kept], R0, 1e13, n_boot=200)
    assert cut.a == pytest.approx(alone.a) and cut.a_ci == pytest.approx(alone.a_ci)
    forecaster = OnlineForecast(ForecastConfig(c_min_fraction=0.2, bootstrap=200), 24)
    forecaster.observe(0, 0.0, R0)
    for step, (c, r) in enumerate(zip(compute, rate, strict=True), start=1):
        row = forecaster.observe(step, float(c), float(r))
    assert row["forecast_points"] == cut.points
