import numpy as np
import pytest

from jaxrl_scale.fit import clean_curve, compare_runs, extrapolation_check, shared_ceiling, sigmoid

C = np.geomspace(300, 30000, 40)


def _curve(name, a, b, c_mid, seed, noise=0.004):
    y = np.asarray(sigmoid(C, a, b, c_mid, 0.3))
    y = y + noise * np.random.default_rng(seed).standard_normal(C.size)
    return clean_curve(C, y, name=name)


def test_shared_ceiling_recovers_common_a_and_orders_b():
    cispo, dapo = _curve("cispo", 0.61, 2.01, 2500.0, 0), _curve("dapo", 0.61, 1.77, 2500.0, 1)
    s = shared_ceiling(cispo, dapo)
    assert s.a == pytest.approx(0.61, abs=0.005)
    assert s.b[0] == pytest.approx(2.01, rel=0.1)
    assert s.b[1] == pytest.approx(1.77, rel=0.1)
    assert s.more_efficient == "cispo"


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
