"""Curve-fitting speed and accuracy: our batched fitter vs scipy, jaxopt's LM, the paper's grid.

    python benchmarks/bench_fit.py [--n 10000] [--scipy-n 2000] [--repeats 5] [--trials 200]

Two data sets, each for every method: 50-point ScaleRL curves with 1% noise, one whose
midpoint sits in the last third of the data ("rising") and one that levelled off early in it
("plateau": the curve the solver needs its long iteration count for), and n pairs-bootstrap
resamples of each. Prints, per curve, fits/s (the median of `--repeats` timed runs, as scipy's),
the ratio to scipy, convergence, and agreement with scipy's A on the same resamples; then the
coverage of the 95% bootstrap interval for A over synthetic curves with known truth.
"""

from __future__ import annotations

import argparse
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from scipy.optimize import curve_fit

from jaxrl_scale.fit import bootstrap_sigmoid, sigmoid
from jaxrl_scale.fit.sigmoid_fit import FitSpec, _grid_start, _residual_and_jac, fit_batch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import jaxopt

TRUTH = dict(a=0.61, b=1.92, c_mid=6000.0, r0=0.30)
C = np.geomspace(100, 20000, 50)  # rising: ln C_mid at 77% of the ln C range
# plateau: ln C_mid at 23% of the ln C range, 90% of its gain made by half of it
CURVES = {"rising": TRUTH, "plateau": dict(a=0.61, b=1.5, c_mid=340.0, r0=0.30)}


def _data(n: int, seed: int = 0, truth: dict = TRUTH):
    rng = np.random.default_rng(seed)
    y = np.asarray(sigmoid(C, **truth)) + 0.01 * rng.standard_normal(C.size)
    counts = rng.multinomial(C.size, np.full(C.size, 1 / C.size), size=n).astype(np.float64)
    return y, counts


def bench_ours(y, counts, n_iter: int, repeats: int = 5, settle: float | None = FitSpec().settle):
    n = counts.shape[0]
    args = (
        jnp.log(jnp.asarray(C, jnp.float32)),
        jnp.broadcast_to(jnp.asarray(y, jnp.float32), counts.shape),
        jnp.asarray(counts, jnp.float32),
        jnp.zeros(n),
        jnp.zeros(n),
    )
    spec = FitSpec(n_iter=n_iter, settle=settle)
    start = time.perf_counter()
    jax.block_until_ready(fit_batch(*args, spec=spec))
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fits = jax.block_until_ready(fit_batch(*args, spec=spec))
        times.append(time.perf_counter() - start)
    return fits, compile_s, n / float(np.median(times))


def bench_jaxopt_lm(y, counts):
    """jaxopt's tolerance-based LevenbergMarquardt from the same grid start, under vmap."""
    log_c = np.log(C)
    x = jnp.asarray((log_c - log_c.mean()) / log_c.std(), jnp.float32)
    spec = FitSpec()
    zero = jnp.zeros(())
    beta_min = jnp.asarray(spec.b_min * log_c.std(), jnp.float32)  # the fitter's floor on B

    def residual(theta, y, w):
        return _residual_and_jac(theta, x, y, w, zero, zero, beta_min, spec)[0]

    lm = jaxopt.LevenbergMarquardt(residual, maxiter=100, tol=1e-6, xtol=1e-8, gtol=1e-8)

    @jax.jit
    def solve(y, w):
        def one(theta0, y, w):
            theta = lm.run(theta0, y, w).params
            r, j = _residual_and_jac(theta, x, y, w, zero, zero, beta_min, spec)
            return theta, r, j

        zeros = jnp.zeros(y.shape[0], y.dtype)
        floors = jnp.full(y.shape[0], beta_min, y.dtype)
        return jax.vmap(one)(_grid_start(x, y, w, zeros, zeros, floors, spec), y, w)

    ys = jnp.broadcast_to(jnp.asarray(y, jnp.float32), counts.shape)
    ws = jnp.asarray(counts, jnp.float32)
    jax.block_until_ready(solve(ys, ws))
    start = time.perf_counter()
    theta, r, j = jax.block_until_ready(solve(ys, ws))
    rate = counts.shape[0] / (time.perf_counter() - start)
    from jaxrl_scale.fit.solver import is_converged

    converged = jax.vmap(is_converged)(r, j)
    a = jax.vmap(
        lambda t: (1 - jax.nn.softplus(t[3])) + jax.nn.softplus(t[3]) * jax.nn.sigmoid(t[0])
    )(theta)
    return np.asarray(a), np.asarray(converged), rate


def _curve(c, a, b, c_mid, r0):
    with np.errstate(all="ignore"):  # scipy probes negative C_mid; the fit copes, quietly
        return r0 + (a - r0) / (1 + (c_mid / c) ** b)


def bench_scipy(y, counts, n: int, repeats: int = 1):
    """scipy's loop over the first n resamples; fits/s the median of `repeats` runs."""
    times = []
    for _ in range(repeats):
        a_fit, ok, rate = _scipy_once(y, counts, n)
        times.append(n / rate)
    return a_fit, ok, n / float(np.median(times))


def _scipy_once(y, counts, n: int):
    a_fit, ok = np.full(n, np.nan), np.zeros(n, bool)
    start = time.perf_counter()
    for i in range(n):
        idx = np.repeat(np.arange(C.size), counts[i].astype(int))
        try:
            # Unbounded Levenberg-Marquardt (MINPACK), scipy's fastest path.
            p, _ = curve_fit(_curve, C[idx], y[idx], p0=[0.6, 1.5, 3000.0, 0.3], maxfev=5000)
            a_fit[i], ok[i] = p[0], bool(np.all(np.isfinite(p)) and 0 < p[0] <= 1.5)
        except (RuntimeError, ValueError):
            pass
    return a_fit, ok, n / (time.perf_counter() - start)


def bench_grid_polyfit(y, counts, n: int, grid: int = 60):
    """The paper's procedure: grid over (A, C_mid), B by least squares, keep the best.

    R0 is held at the first point's reward; B comes from the linearised curve
    ln((A - R) / (R - R0)) = B * (ln C_mid - ln C), a line through the origin."""
    a_grid = np.linspace(y.max() - 0.02, 1.0, grid)
    cm_grid = np.geomspace(C[0], C[-1] * 10, grid)
    a_fit = np.full(n, np.nan)
    start = time.perf_counter()
    for i in range(n):
        idx = np.repeat(np.arange(C.size), counts[i].astype(int))
        c, r = C[idx], y[idx]
        r0 = r[np.argmin(c)]
        aa, cm = np.meshgrid(a_grid, cm_grid, indexing="ij")
        aa, cm = aa[..., None], cm[..., None]
        ok = (r > r0 + 1e-6) & (r < aa - 1e-6)
        lhs = np.where(ok, np.log(np.clip((aa - r) / np.clip(r - r0, 1e-9, None), 1e-9, None)), 0)
        rhs = np.where(ok, np.log(cm) - np.log(c), 0)
        b = np.clip(np.sum(lhs * rhs, -1) / np.maximum(np.sum(rhs * rhs, -1), 1e-12), 1e-3, 50)
        pred = _curve(c, aa, b[..., None], cm, r0)
        best = np.unravel_index(np.argmin(np.sum((pred - r) ** 2, -1)), b.shape)
        a_fit[i] = a_grid[best[0]]
    return a_fit, n / (time.perf_counter() - start)


def coverage(trials: int, n_boot: int) -> float:
    truth = dict(a=0.61, b=1.92, c_mid=2542.0, r0=0.30)
    c = np.geomspace(300, 20000, 40)
    hits = 0
    for t in range(trials):
        rng = np.random.default_rng(1000 + t)
        y = np.clip(np.asarray(sigmoid(c, **truth)) + 0.01 * rng.standard_normal(c.size), 0, 1)
        lo, hi = bootstrap_sigmoid(c, y, n=n_boot, seed=t).ci["a"]
        hits += lo <= truth["a"] <= hi
    return hits / trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=10_000, help="bootstrap fits for our fitter")
    parser.add_argument("--scipy-n", type=int, default=2000, help="fits for the slow baselines")
    parser.add_argument("--n-iter", type=int, default=FitSpec().n_iter)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs; the median counts")
    parser.add_argument("--curves", nargs="+", default=sorted(CURVES), choices=sorted(CURVES))
    parser.add_argument("--trials", type=int, default=200, help="coverage trials (0: skip)")
    args = parser.parse_args()

    m = args.scipy_n
    for curve in args.curves:
        y, counts = _data(args.n, truth=CURVES[curve])
        fits, compile_s, rate = bench_ours(y, counts, args.n_iter, args.repeats)
        _, _, rate_fixed = bench_ours(y, counts, args.n_iter, args.repeats, settle=None)
        a_ours, conv = np.asarray(fits.a), np.asarray(fits.converged)
        a_sp, ok_sp, rate_sp = bench_scipy(y, counts, m, args.repeats)
        a_lm, conv_lm, rate_lm = bench_jaxopt_lm(y, counts)
        a_grid, rate_grid = bench_grid_polyfit(y, counts, min(m, 500))

        both = ok_sp & conv[:m]
        diff = np.abs(a_ours[:m] - a_sp)[both]
        print(f"\n{curve}: 50-point curve {CURVES[curve]}, 1% noise; {args.n:,} resamples; "
              f"fits/s the median of {args.repeats} runs")  # fmt: skip
        print(f"{'method':<30}{'fits/s':>12}{'x scipy':>10}{'converged':>11}"
              "  |A - A_scipy| median / p99")  # fmt: skip
        rows = [
            ("ours (batched LM)", rate, conv.mean(), diff),
            (f"ours, all {args.n_iter} iterations", rate_fixed, float("nan"), np.zeros(1)),
            ("jaxopt LevenbergMarquardt", rate_lm, conv_lm.mean(), np.abs(a_lm[:m] - a_sp)[ok_sp]),
            ("scipy curve_fit loop", rate_sp, ok_sp.mean(), np.zeros(1)),
            ("grid(A, C_mid) + polyfit", rate_grid, 1.0, np.abs(a_grid - a_sp[: a_grid.size])),
        ]
        for name, r, c, d in rows:
            spread = f"{np.median(d):.1e} / {np.quantile(d, 0.99):.1e}"
            print(f"{name:<30}{r:>12,.0f}{r / rate_sp:>10.1f}{c:>11.2%}  {spread}")
        truth = CURVES[curve]["a"]
        print(f"ours: compile {compile_s:.2f} s; A median {np.median(a_ours):.4f} (truth {truth})")
        print(f"{curve}: {rate:,.0f} fits/s, {rate / rate_sp:.1f}x scipy "
              f"(goal 200,000 and 50x); {rate / rate_lm:.1f}x jaxopt LM")  # fmt: skip
    if args.trials:
        cov = coverage(args.trials, 1000)
        print(f"95% bootstrap interval for A covers the truth in {cov:.1%} of {args.trials} curves")


if __name__ == "__main__":
    main()
