"""Fits of runs shaped like real ones: per-parameter identification with the true reason, the
floor on B, known sampling noise, the decline test, and what the CLI and the online forecast
say about them."""

import json

import numpy as np
import pytest

from jaxrl_scale.cli import main
from jaxrl_scale.config import ForecastConfig
from jaxrl_scale.fit import Curve, bootstrap_sigmoid, fit_sigmoid, sigmoid
from jaxrl_scale.fit.decline import detect_decline, window_size
from jaxrl_scale.fit.forecast import OnlineForecast, fit_forecast

STEPS = np.arange(1, 13) / 12.0  # 12 evals at equal step intervals


def _curve(c_mid, *, sd=0.01, seed=0, a=0.7, b=1.5, r0=0.3, compute=STEPS):
    rng = np.random.default_rng(seed)
    return np.asarray(sigmoid(compute, a, b, c_mid, r0)) + sd * rng.standard_normal(compute.size)


def test_a_run_that_rose_before_its_first_eval_has_a_identified_and_not_b_or_c_mid():
    y = _curve(c_mid=0.3 * STEPS[0], sd=0.005)
    boot = bootstrap_sigmoid(STEPS, y, n=400, r0=0.3, eval_sd=0.005)
    assert boot.identified == {"a": True, "b": False, "c_mid": False}
    assert "rose before the first eval" in boot.why_not["b"]
    assert boot.ci["a"][0] <= 0.7 <= boot.ci["a"][1]


def test_a_run_short_of_its_inflection_names_that_reason_and_the_rise_is_seen():
    compute = np.geomspace(0.05, 0.3, 12)
    y = _curve(c_mid=1.0, sd=0.003, compute=compute)
    boot = bootstrap_sigmoid(compute, y, n=400, r0=0.3)
    assert not boot.identified["a"]
    assert "do not reach the curve's inflection" in boot.why_not["a"]
    assert boot.to_dict()["not_identified"]["a"] == boot.why_not["a"]


def test_a_run_that_never_rises_above_r0_says_so_rather_than_blaming_the_inflection():
    rng = np.random.default_rng(3)
    y = 0.3 - 0.02 * STEPS + 0.005 * rng.standard_normal(STEPS.size)  # a slow slide below R0
    boot = bootstrap_sigmoid(STEPS, y, n=200, r0=0.3)
    assert not any(boot.identified.values())
    why = boot.why_not["a"]  # (the level it holds, at R0: fit/level.py)
    assert "no rise" in why and "no higher than R0 = 0.300" in why
    assert "inflection" not in why


def test_a_run_whose_inflection_is_inside_the_data_has_everything_identified():
    y = _curve(c_mid=0.3, sd=0.004, b=2.0)
    boot = bootstrap_sigmoid(STEPS, y, n=400, r0=0.3, eval_sd=0.004)
    assert boot.identified == {"a": True, "b": True, "c_mid": True}


def test_levelled_off_data_put_the_ceiling_at_the_plateau_not_anywhere_above_it():
    # Flat at 0.69 from the first eval on: without a floor on B, a curve still rising beyond
    # the data (B -> 0) fits as well with any ceiling up to 1.
    rng = np.random.default_rng(3)
    y = 0.69 + 0.01 * rng.standard_normal(STEPS.size)
    fit = fit_sigmoid(STEPS, y, r0=0.3)
    assert bool(fit.converged)
    assert float(fit.a) == pytest.approx(np.mean(y), abs=0.01)
    assert float(fit.b) >= 0.5


def test_a_known_eval_size_sets_the_noise_floor_the_intervals_respect():
    rng = np.random.default_rng(5)
    p = np.asarray(sigmoid(STEPS, 0.7, 1.5, 0.3 * STEPS[0], 0.3))
    y = rng.binomial(1319, p) / 1319
    told = bootstrap_sigmoid(STEPS, y, n=400, r0=0.3, eval_size=1319)
    binomial_sd = np.sqrt(0.7 * 0.3 / 1319)
    # The noise is never believed smaller than the sampling noise the eval size implies ...
    assert told.noise_sd >= 0.95 * binomial_sd
    # ... and an interval for an eval at the end holds at least that eval's binomial noise.
    lo, _, hi = (float(v) for v in told.predict_ci(1.0, observation_noise=True))
    assert hi - lo >= 0.9 * 2 * 1.96 * binomial_sd
    assert told.to_dict()["eval_size"] == 1319
    with pytest.raises(ValueError, match="eval_size"):
        bootstrap_sigmoid(STEPS, y, n=10, r0=0.3, eval_size=0)


def _declining(drop, seed=0, points=24, sd=0.01):
    compute = np.arange(1, points + 1) / points
    mean = np.asarray(sigmoid(compute, 0.7, 1.5, 0.03, 0.3))
    mean = mean - drop * np.clip((compute - 0.6) / 0.4, 0, None)
    rng = np.random.default_rng(seed)
    return compute, mean + sd * rng.standard_normal(points)


def test_a_run_that_falls_after_a_peak_is_declining_with_its_peak_and_drop():
    compute, y = _declining(0.12)
    found = detect_decline(Curve("r", compute, y, sd=np.full(y.size, 0.01)), r0=0.3)
    assert found is not None
    h = window_size(y.size)
    windows = np.convolve(y, np.ones(h) / h, mode="valid")
    best = int(np.argmax(windows[: windows.size - h]))  # by hand: the best window before the last
    assert found.drop == pytest.approx(windows[best] - windows[-1])
    assert found.peak_x == pytest.approx(compute[best + h - 1])
    assert 0.08 <= found.drop <= 0.16
    assert "declining" in found.message("r")


def test_flat_runs_with_drifting_noise_are_rarely_called_declining():
    rng = np.random.default_rng(11)
    called = 0
    for seed in range(16):
        e = np.empty(24)
        e[0] = rng.standard_normal()
        for t in range(1, 24):
            e[t] = 0.6 * e[t - 1] + 0.8 * rng.standard_normal()
        y = 0.65 + 0.015 * e
        called += detect_decline(Curve("r", STEPS[:1] * np.arange(1, 25), y), seed=seed) is not None
    assert called <= 3  # a 5% test: 0.8 expected of 16; 4 or more has probability < 1%


def test_fit_cli_names_declining_runs_reports_identification_and_does_not_rank_them(
    tmp_path, capsys
):
    compute, y = _declining(0.12)
    rising = _curve(c_mid=0.3 * STEPS[0], sd=0.005, seed=1)
    for name, cs, ys in (("falls", compute, y), ("rises", STEPS, rising)):
        rows = ["compute,pass_rate", "0,0.3"] + [f"{c},{r}" for c, r in zip(cs, ys, strict=True)]
        (tmp_path / f"{name}.csv").write_text("\n".join(rows) + "\n")
    files = [str(tmp_path / "falls.csv"), str(tmp_path / "rises.csv")]
    args = ["fit", *files, "--x", "compute", "--y", "pass_rate", "--bootstrap", "200"]
    assert main([*args, "--eval-size", "1319", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    by_name = {r["run"]: r for r in report["runs"]}
    assert report["declining"] == ["falls"] and report["ranking"] == ["rises"]
    assert any("declining" in w for w in by_name["falls"]["warnings"])
    assert by_name["rises"]["identified"] == {"a": True, "b": False, "c_mid": False}
    assert by_name["rises"]["eval_size"] == 1319
    assert main(args + ["--eval-size", "1319"]) == 0
    table = capsys.readouterr().out
    assert "identified" in table.splitlines()[0]
    assert "declining, not ranked: falls" in table
    assert "B and C_mid are not identified (the curve rose before the first eval" in table
    with pytest.raises(SystemExit):
        main([*args, "--eval-size", "0"])


def test_online_forecast_says_declining_and_can_stop_the_run():
    compute, y = _declining(0.12)
    cfg = ForecastConfig(every=len(y), bootstrap=200, stop_when_declining=True)
    forecaster = OnlineForecast(cfg, total_steps=len(y))
    forecaster.observe(0, 0.0, 0.3, 0.01)
    for step, (c, r) in enumerate(zip(compute, y, strict=True), start=1):
        row = forecaster.observe(step, float(c), float(r), 0.01)
    assert row["forecast_status"] == "declining"
    assert row["forecast_decline_drop"] > 0.05
    assert "forecast_a" not in row
    assert "stop_when_declining" in forecaster.should_stop()


def test_online_forecast_reports_what_is_identified_and_an_interval_with_the_eval_noise():
    y = _curve(c_mid=0.3 * STEPS[0], sd=0.01, seed=2)
    forecast = fit_forecast(STEPS, y, 0.3, budget=1.0, n_boot=400, eval_sd=np.full(12, 0.01))
    assert forecast.ok and forecast.identified == "A"
    row = forecast.row()
    assert row["forecast_identified"] == "A"
    # An eval at the budget carries its own noise: the interval is at least that wide.
    assert row["forecast_at_budget_hi"] - row["forecast_at_budget_lo"] >= 0.9 * 2 * 1.96 * 0.01


def test_a_run_that_collapses_right_after_its_first_evals_is_declining():
    # The CPU demo at a learning rate too high for LoRA: R0 0.47, three evals near it, then a
    # collapse to zero (the evals after the peak are the noise reference).
    y = np.array([0.505, 0.422, 0.302, 0.028, 0.005] + [0.0] * 15)
    sd = np.sqrt(np.clip(y, 1e-3, None) * (1 - y) / 2048)
    found = detect_decline(Curve("r", STEPS[:1] * np.arange(1, 21), y, sd=sd), r0=0.47)
    assert found is not None
    assert found.drop == pytest.approx(np.mean(y[:3]))  # by hand: windows of 3, last is 0


def test_flat_runs_whose_best_evals_come_first_are_rarely_called_declining():
    # The best window is the first one, so the noise is read after it: still a 5% test.
    called = tried = 0
    rng = np.random.default_rng(5)
    while tried < 16:
        y = 0.65 + 0.015 * rng.standard_normal(20)
        windows = np.convolve(y, np.ones(3) / 3, mode="valid")
        if int(np.argmax(windows[:-3])) > 2:
            continue  # the peak is late enough for the rising fit
        tried += 1
        curve = Curve("r", STEPS[:1] * np.arange(1, 21), y, sd=np.full(20, 0.015))
        called += detect_decline(curve, r0=0.65, seed=tried) is not None
    assert called <= 3
