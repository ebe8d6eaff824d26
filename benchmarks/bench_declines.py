"""Which declines does `detect_decline` name? A power table, and false alarms on healthy runs.

    python benchmarks/bench_declines.py [--runs 200] [--eval-sizes 500 1319] [--evals 20 40]

Each run: evals at equal compute steps, a rise that is nearly done by the first eval (as real RL
curves are), then for a declining run a fall of `drop` spread over its last `after` evals
(linear from the peak); the policy's true rate drifts between checkpoints (AR(1), sd 0.01,
coefficient 0, 0.5 or 0.8 drawn per run, as bench_forecasts.py's runs), and the eval is
binomial on `eval size` problems (the fitter is told the size). Healthy runs (drop 0)
measure the false-alarm rate, which should stay at or under 5%.
Prints the fraction of runs called declining per (eval size, evals, evals after the peak,
drop), `--runs` runs each, and below each row ("best") the power of the most powerful test
there could be (Neyman-Pearson) for the same runs, one told the level before the fall, where
the fall starts, its shape and the noise's covariance (sampling and drift): what no test of
real evals can beat, since it knows what a real test has to estimate.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
from scipy.stats import norm

from jaxrl_scale.fit import sigmoid
from jaxrl_scale.fit.data import Curve
from jaxrl_scale.fit.decline import detect_decline

DROPS = (0.0, 0.02, 0.04, 0.06, 0.08)
AFTER = (4, 6, 8)
DRIFT_SD = 0.01


def draw(rng, evals: int, size: int, drop: float, after: int):
    compute = np.arange(1, evals + 1, dtype=float)
    a, r0 = rng.uniform(0.5, 0.7), rng.uniform(0.2, 0.35)
    mean = np.asarray(sigmoid(compute, a, rng.uniform(0.8, 2.0), rng.uniform(0.3, 0.9), r0))
    if drop:
        peak = evals - after  # the last eval before the fall
        mean = mean - drop * np.clip((compute - peak) / after, 0, None)
    rho = float(rng.choice([0.0, 0.5, 0.8]))
    drift = np.zeros(evals)
    if rho:
        drift[0] = DRIFT_SD * rng.standard_normal()
        for t in range(1, evals):
            drift[t] = rho * drift[t - 1] + np.sqrt(1 - rho**2) * DRIFT_SD * rng.standard_normal()
    rates = rng.binomial(size, np.clip(mean + drift, 0, 1)) / size
    return compute, rates, rng.binomial(size, r0) / size, (mean, rho)


def best_power(mean: np.ndarray, rho: float, size: int, drop: float, after: int) -> float:
    """The Neyman-Pearson test's power at level 0.05 for this run: the fall s over the last
    `after` evals, against a level known exactly, under the evals' covariance (binomial
    sampling at the true rates plus the AR(1) drift): Phi(sqrt(s' Sigma^-1 s) - z_0.95)."""
    if not drop:
        return 0.05
    s = drop * np.arange(1, after + 1) / after
    rate = np.clip(mean[-after:], 0.0, 1.0)
    lags = np.abs(np.subtract.outer(np.arange(after), np.arange(after)))
    cov = np.diag(rate * (1 - rate) / size) + (DRIFT_SD**2 * rho**lags if rho else 0.0)
    return float(norm.cdf(np.sqrt(s @ np.linalg.solve(cov, s)) - norm.ppf(0.95)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--eval-sizes", type=int, nargs="+", default=[500, 1319])
    parser.add_argument("--evals", type=int, nargs="+", default=[20, 40])
    args = parser.parse_args()
    start = time.perf_counter()
    print(f"fraction of {args.runs} runs called declining (drop 0: false alarms)")
    print(f"{'eval size':>9}{'evals':>7}{'after':>7}" + "".join(f"{d:>8.2f}" for d in DROPS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for size in args.eval_sizes:
            for evals in args.evals:
                for after in AFTER:
                    cells, best = [], []
                    for drop in DROPS:
                        rng = np.random.default_rng([size, evals, after, int(drop * 100)])
                        called, power = 0, 0.0
                        for i in range(args.runs):
                            c, y, r0, (mean, rho) = draw(rng, evals, size, drop, after)
                            found = detect_decline(Curve("run", c, y), r0=r0, eval_size=size,
                                                   seed=i)  # fmt: skip
                            called += found is not None
                            power += best_power(mean, rho, size, drop, after)
                        cells.append(called / args.runs)
                        best.append(power / args.runs)
                    print(f"{size:>9}{evals:>7}{after:>7}"
                          + "".join(f"{v:>8.0%}" for v in cells), flush=True)  # fmt: skip
                    print(f"{'best':>23}" + "".join(f"{v:>8.0%}" for v in best), flush=True)
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
