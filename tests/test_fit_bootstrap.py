import numpy as np
import pytest

from jaxrl_scale.fit import CurveDataError, bootstrap_sigmoid, fit_sigmoid, sigmoid

TRUTH = dict(a=0.61, b=1.92, c_mid=2542.0, r0=0.30)
C = np.geomspace(300, 20000, 40)


def _noisy(seed, noise=0.01, c=C, truth=TRUTH):
    rng = np.random.default_rng(seed)
    return np.clip(np.asarray(sigmoid(c, **truth)) + noise * rng.standard_normal(c.size), 0, 1)


def test_contract_shapes_and_fields():
    boot = bootstrap_sigmoid(C, _noisy(0), n=500, seed=0)
    assert set(boot.ci) == {"a", "b", "c_mid", "r0"}
    assert boot.samples["a"].shape == (500,)
    lo, hi = boot.ci["a"]
    assert lo < float(boot.fit.a) < hi
    lo, mid, hi = boot.predict_ci(np.array([1e3, 1e5]))
    assert lo.shape == mid.shape == hi.shape == (2,)
    assert np.all(lo <= mid) and np.all(mid <= hi)
    assert boot.converged_fraction > 0.99


def test_same_seed_same_intervals_other_seed_differs():
    y = _noisy(1)
    a = bootstrap_sigmoid(C, y, n=300, seed=4).ci["a"]
    assert bootstrap_sigmoid(C, y, n=300, seed=4).ci["a"] == a
    assert bootstrap_sigmoid(C, y, n=300, seed=5).ci["a"] != a


def test_coverage_of_a_over_200_synthetic_curves():
    """95% intervals for A contain the truth in 90-98% of 200 noisy curves (1% noise); 400
    resamples each (measured: 0.970 of the 200 covered, 0.975 with 1,000)."""
    hits = 0
    for trial in range(200):
        lo, hi = bootstrap_sigmoid(C, _noisy(1000 + trial), n=400, seed=trial).ci["a"]
        hits += lo <= TRUTH["a"] <= hi
    assert 0.90 <= hits / 200 <= 0.98, hits / 200


@pytest.mark.parametrize("method", ["residual", "block"])
def test_other_methods_give_sensible_intervals(method):
    boot = bootstrap_sigmoid(C, _noisy(2), n=1000, method=method)
    lo, hi = boot.ci["a"]
    assert lo <= TRUTH["a"] <= hi
    assert hi - lo < 0.05


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_interval_is_wide_when_data_stop_before_the_inflection(seed):
    early = np.geomspace(100, 1200, 25)  # ends at a quarter of C_mid
    truth = dict(a=0.61, b=1.92, c_mid=5000.0, r0=0.3)
    boot = bootstrap_sigmoid(early, _noisy(seed, c=early, truth=truth), n=1000)
    full = bootstrap_sigmoid(C, _noisy(seed), n=1000)
    assert not boot.identifiable and full.identifiable
    lo, hi = boot.ci["a"]
    assert lo <= truth["a"] <= hi
    assert hi - lo > 0.3 > 4 * (full.ci["a"][1] - full.ci["a"][0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="method"):
        bootstrap_sigmoid(C, _noisy(0), n=10, method="jackknife")
    with pytest.raises(ValueError, match="level"):
        bootstrap_sigmoid(C, _noisy(0), n=10, level=95)


def test_a_resample_with_no_spare_points_does_not_count_as_converged():
    """A curve of 5 points with R0 held has 3 free parameters and needs 4 distinct points to
    leave a residual degree of freedom. A pairs resample draws 4 or 5 distinct points with
    probability (S(5,4) 5!/1! + S(5,5) 5!) / 5^5 = 1320 / 3125 = 0.4224 (S: Stirling numbers of
    the second kind); the other resamples fit exactly and must not count."""
    c = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
    r = sigmoid(c, 0.8, 1.5, 4.0, 0.2) + np.array([0.01, -0.01, 0.01, -0.01, 0.01])
    boot = bootstrap_sigmoid(c, r, n=4000, seed=3, r0=0.2, method="pairs")
    assert abs(boot.converged_fraction - 0.4224) < 0.03


def test_the_point_fit_needs_more_points_than_free_parameters():
    c = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 32.0])
    r = sigmoid(c, 0.8, 1.5, 4.0, 0.2) + 0.004 * np.array([1, -1, 1, -1, 1, -1])
    keep = lambda k: np.arange(6)[None, :] < k  # noqa: E731  the first k points
    batch = np.broadcast_to(c, (1, 6)), np.broadcast_to(r, (1, 6))
    with pytest.raises(CurveDataError, match="3 distinct points"):  # refused up front
        fit_sigmoid(*batch, r0=0.2, mask=keep(3))
    assert bool(fit_sigmoid(*batch, r0=0.2, mask=keep(4)).converged[0])  # 3 free parameters
    # R0 free: 4 parameters, so 4 points fit exactly and say nothing; 5 leave one to spare.
    free = [bool(fit_sigmoid(*batch, mask=keep(k)).converged[0]) for k in (4, 5)]
    assert free == [False, True]


def test_no_converged_resample_gives_no_interval_rather_than_an_error():
    c = np.array([1.0, 2.0, 4.0, 8.0])  # R0 free: 4 parameters, no resample can converge
    r = sigmoid(c, 0.8, 1.5, 3.0, 0.2)
    boot = bootstrap_sigmoid(c, r + np.array([0.01, -0.01, 0.01, -0.01]), n=200)
    assert boot.converged_fraction == 0 and not boot.identifiable
    lo, mid, hi = boot.predict_ci(16.0)
    assert np.isnan(lo) and np.isnan(hi) and np.isfinite(mid)


def test_noise_model_matches_the_restricted_likelihood_written_out():
    """The tridiagonal shortcut equals the REML posterior computed the long way: residuals
    projected onto the complement of the Jacobian, Q' R Q formed and factorised explicitly."""
    from jaxrl_scale.fit.noise import noise_model

    rng = np.random.default_rng(3)
    p, k = 12, 3
    jac = rng.standard_normal((p, k))
    e = rng.standard_normal(p)
    e -= jac @ np.linalg.lstsq(jac, e, rcond=None)[0]  # least-squares residuals
    grid = np.array([-0.5, 0.0, 0.3, 0.8])
    got = noise_model(e, jac, grid, prior="flat")
    q = np.linalg.qr(jac, mode="complete")[0][:, k:]  # orthonormal basis of the residual space
    lags = np.abs(np.subtract.outer(np.arange(p), np.arange(p)))
    log_post, scale = [], []
    for rho in grid:
        s = q.T @ rho**lags @ q
        quad = (q.T @ e) @ np.linalg.solve(s, q.T @ e)
        log_post.append(-0.5 * np.linalg.slogdet(s)[1] - 0.5 * (p - k) * np.log(quad))
        scale.append(quad / (p - k))
    want = np.exp(np.array(log_post) - max(log_post))
    np.testing.assert_allclose(got.weight, want / want.sum(), rtol=1e-9)
    np.testing.assert_allclose(got.scale, scale, rtol=1e-9)
    assert got.dof == p - k
    # The default prior, Jeffreys' for AR(1), reweighs the same likelihood by (1 - rho^2)^-1/2.
    jeffreys = want / np.sqrt(1 - grid**2)
    default = noise_model(e, jac, grid).weight
    np.testing.assert_allclose(default, jeffreys / jeffreys.sum(), rtol=1e-9)
    with pytest.raises(ValueError, match="prior"):
        noise_model(e, jac, grid, prior="uniform")


def test_noise_model_reads_drift_as_correlation():
    from jaxrl_scale.fit.noise import noise_model

    jac = np.stack([np.ones(40), np.linspace(0, 1, 40)], axis=1)  # a line absorbs level + trend
    drift = np.sin(np.linspace(0, 6 * np.pi, 40))  # slow: successive errors alike
    alternating = np.array([1.0, -1.0] * 20)
    assert noise_model(drift, jac).mean_rho > 0.6
    assert noise_model(alternating, jac).mean_rho < -0.6


def test_auto_intervals_widen_when_the_residuals_drift_together():
    """The same 20 errors in two orders: drifting (two slow waves the sigmoid cannot absorb)
    and alternating. Pairs resampling cannot tell them apart; auto widens only the first."""
    c = np.linspace(0.05, 1.0, 20)
    truth = np.asarray(sigmoid(c, 0.8, 2.0, 0.3, 0.3))
    slow = 0.015 * np.sin(np.linspace(0, 4 * np.pi, 20))
    low_first = np.sort(slow)
    fast = np.empty(20)
    fast[0::2], fast[1::2] = low_first[:10], low_first[10:][::-1]  # small, large, small, ...
    width = lambda b: b.ci["a"][1] - b.ci["a"][0]  # noqa: E731
    auto = {
        k: bootstrap_sigmoid(c, truth + e, n=1000, r0=0.3)
        for k, e in (("slow", slow), ("fast", fast))
    }
    pairs = {k: bootstrap_sigmoid(c, truth + e, n=1000, r0=0.3, method="pairs")
             for k, e in (("slow", slow), ("fast", fast))}  # fmt: skip
    assert auto["slow"].method == "auto"
    assert auto["slow"].autocorrelation > 0.5 and auto["fast"].autocorrelation < -0.5
    assert width(pairs["slow"]) < 1.3 * width(pairs["fast"])
    assert width(auto["slow"]) > 2 * width(auto["fast"])
    assert auto["slow"].noise_samples.shape == (1000,)
    assert np.all(np.asarray(auto["slow"].noise_samples) > 0)


def test_auto_gives_no_interval_without_a_spare_point():
    c = np.array([1.0, 2.0, 4.0, 8.0])  # R0 free: 4 points, 4 parameters, no noise estimate
    boot = bootstrap_sigmoid(c, np.asarray(sigmoid(c, 0.8, 1.5, 3.0, 0.2)) + 0.01, n=100)
    assert boot.converged_fraction == 0 and np.isnan(boot.ci["a"][0])


def test_forecasts_of_many_runs_compile_once():
    """The online forecast and the calibration benchmark call predict_ci once per fit, and the
    number of converged resamples differs from fit to fit: that must not compile anything
    again (it used to cost about a second per call)."""
    import jax.monitoring

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **_: (
            compiles.append(event)
            if event == "/jax/core/compile/backend_compile_duration"
            else None
        )
    )
    c = np.linspace(1.0, 10.0, 8)
    boots = [bootstrap_sigmoid(c, _noisy(s, 0.02, c, dict(TRUTH, c_mid=4.0)), n=300, seed=s)
             for s in range(4)]  # fmt: skip
    kept = {int(np.sum(np.asarray(b.converged))) for b in boots}
    assert len(kept) > 1  # the case this test is about: different converged counts
    for noise in (False, True):
        boots[0].predict_ci(12.0, observation_noise=noise)
    before = len(compiles)
    for b in boots[1:]:
        for noise in (False, True):
            b.predict_ci(12.0, observation_noise=noise)
    assert len(compiles) == before
