import dataclasses

import numpy as np
import pytest

from jaxrl_scale.fit import (
    SharedCeiling,
    clean_curve,
    compare_runs,
    extrapolation_check,
    fit_sigmoid,
    shared_ceiling,
    sigmoid,
)

C = np.geomspace(300, 30000, 40)


def _curve(name, a, b, c_mid, seed, noise=0.004):
    y = np.asarray(sigmoid(C, a, b, c_mid, 0.3))
    y = y + noise * np.random.default_rng(seed).standard_normal(C.size)
    return clean_curve(C, y, name=name)


def test_shared_ceiling_recovers_common_a_and_orders_b():
    cispo, dapo = _curve("cispo", 0.61, 2.01, 2500.0, 0), _curve("dapo", 0.61, 1.77, 2500.0, 1)
    s = shared_ceiling(cispo, dapo, n_boot=500)
    assert s.a == pytest.approx(0.61, abs=0.005)
    assert s.b[0] == pytest.approx(2.01, rel=0.1)
    assert s.b[1] == pytest.approx(1.77, rel=0.1)
    assert s.more_efficient == "cispo"
    lo, hi = s.b_diff_ci
    assert 0 < lo < 2.01 - 1.77 < hi  # the true difference, and 0 is outside: a real gap
    assert s.distinguishable and s.verdict == "cispo"


def test_shared_a_is_the_mean_of_the_two_ceilings_with_each_r0_held():
    """The paper's rule: A fixed at the mean of the runs' own A, R0 held at each run's start
    (where the curve has one), not refitted (a free R0 lets the shared A sit above both)."""
    first = dataclasses.replace(_curve("first", 0.60, 2.0, 2500.0, 3), r0=0.3)
    second = _curve("second", 0.62, 1.6, 2500.0, 4)  # no start measured: R0 fitted
    s = shared_ceiling(first, second, n_boot=200)
    own = [float(fit_sigmoid(c.compute, c.reward, r0=c.r0).a) for c in (first, second)]
    assert s.a == pytest.approx(np.mean(own), abs=1e-6)
    assert s.r0[0] == pytest.approx(0.3, abs=1e-6) and abs(s.r0[1] - 0.3) > 1e-4


def test_two_runs_of_one_recipe_are_indistinguishable():
    """Same truth, different noise: the B difference interval covers 0 (a verdict without an
    interval would name one of them "faster")."""
    a, b = _curve("seed0", 0.61, 1.9, 2500.0, 5, 0.01), _curve("seed1", 0.61, 1.9, 2500.0, 6, 0.01)
    s = shared_ceiling(a, b, n_boot=500)
    lo, hi = s.b_diff_ci
    assert lo < 0 < hi and not s.distinguishable and s.verdict == "indistinguishable"


def test_identical_runs_give_an_interval_around_zero():
    """The same data twice: the point fits agree exactly (B difference 0) and the resamples of
    each run scatter alike, so the interval sits about 0."""
    run = dataclasses.replace(_curve("run", 0.61, 1.9, 2500.0, 8), r0=0.3)
    s = shared_ceiling(run, dataclasses.replace(run, name="copy"), n_boot=200)
    assert s.b[0] == s.b[1]
    lo, hi = s.b_diff_ci
    assert lo < 0 < hi and s.verdict == "indistinguishable"
    assert abs(lo + hi) < (hi - lo) / 2  # centred: its midpoint within a quarter-width of 0


def test_very_different_b_is_distinguishable():
    slow = dataclasses.replace(_curve("slow", 0.61, 1.2, 2500.0, 9, 0.01), r0=0.3)
    fast = dataclasses.replace(_curve("fast", 0.61, 3.0, 2500.0, 10, 0.01), r0=0.3)
    s = shared_ceiling(slow, fast, n_boot=200)
    assert s.b_diff_ci[1] < 0 and s.verdict == "fast"


def test_held_r0_carries_its_eval_noise():
    """R0 held at the step-0 eval is one noisy measurement however many evals follow: with 100
    evals the data pin B down and the pairs interval (R0 taken as exact) shrinks, but "auto"
    redraws the held R0 in every resample and keeps that noise. (The noise here is independent
    and 100 evals put the AR(1) posterior near 0: on these runs, auto's interval measured 3.6x
    as wide as pairs' with R0 held, 1.2x with R0 fitted instead.)"""
    c = np.geomspace(300, 30000, 100)

    def run(name, seed):
        noise = 0.01 * np.random.default_rng(seed).standard_normal(c.size)
        y = np.asarray(sigmoid(c, 0.61, 1.9, 2500.0, 0.3)) + noise
        return dataclasses.replace(clean_curve(c, y, name=name), r0=0.3)

    def width(method):
        s = shared_ceiling(run("a", 11), run("b", 12), n_boot=200, method=method)
        return s.b_diff_ci[1] - s.b_diff_ci[0]

    assert width("auto") > 2 * width("pairs")


def test_no_interval_is_no_difference():
    """Where no resample converged the interval is NaN, and NaN excludes nothing."""
    nan = SharedCeiling(("a", "b"), 0.6, (2.0, 1.0), (1.0, 1.0), (0.3, 0.3), (np.nan, np.nan), 0.95)
    assert not nan.distinguishable and nan.verdict == "indistinguishable"
    run = _curve("a", 0.6, 2.0, 2500.0, 0)
    with pytest.raises(ValueError, match="method"):
        shared_ceiling(run, run, method="jackknife")


def test_compare_ranks_by_a_and_refits_only_close_pairs():
    runs = [
        _curve("small_batch", 0.52, 1.9, 2000.0, 2),
        _curve("dapo", 0.605, 1.77, 2500.0, 1),
        _curve("cispo", 0.61, 2.01, 2500.0, 0),
    ]
    cmp = compare_runs(runs, n_boot=300)
    assert cmp.ranking[-1] == "small_batch"
    assert set(cmp.ranking[:2]) == {"cispo", "dapo"}
    assert [set(s.runs) for s in cmp.shared] == [{"cispo", "dapo"}]
    assert cmp.shared[0].more_efficient == "cispo"
    lo, hi = cmp.boots["small_batch"].ci["a"]
    assert lo <= 0.52 <= hi


def test_a_run_that_holds_a_level_ranks_by_its_level():
    """Five evals of 500 problems at 0.5 with no step 0 (a distilled start that RL leaves
    where it was) against a run climbing to 0.6: the flat run's sigmoid is a curve through
    the noise with a ceiling of 0.84; it holds 0.50, and ranks below the climbing run."""
    c = np.geomspace(300, 30000, 5)
    flat = clean_curve(c, np.random.default_rng(5).binomial(500, 0.5, size=5) / 500, name="flat")
    cmp = compare_runs([_curve("climbing", 0.6, 1.9, 2000.0, 2), flat], n_boot=300)
    boot = cmp.boots["flat"]
    assert boot.on_level and float(boot.fit.a) > 0.7 and boot.flat.mean < 0.55
    assert cmp.ranking == ["climbing", "flat"]


def test_extrapolation_check_fits_early_points_and_scores_the_last():
    truth = dict(a=0.61, b=1.92, c_mid=2542.0, r0=0.30)
    y = np.asarray(sigmoid(C, **truth)) + 0.005 * np.random.default_rng(7).standard_normal(C.size)
    report = extrapolation_check(C, y, fit_until=0.5, n_boot=500)
    assert report.c_cut == pytest.approx(0.5 * C[-1])
    cut = 0.5 * C[-1]
    assert report.n_fit == int(np.sum(cut >= C))
    assert report.actual == pytest.approx(y[-1])
    assert report.error == pytest.approx(report.predicted - y[-1])
    assert report.lo < report.predicted < report.hi
    assert report.covered == (report.lo <= y[-1] <= report.hi)
    assert abs(report.predicted - float(sigmoid(C[-1], **truth))) < 0.02
    with pytest.raises(ValueError, match="fit_until"):
        extrapolation_check(C, y, fit_until=1.5)
