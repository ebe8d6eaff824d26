"""Forecasts on runs shaped like real ones: what is identified, declines, interval sharpness.

    python benchmarks/bench_forecasts.py [--runs 200] [--boot 400] [--families ...] [--no-eval-size]

Real RL post-training curves (GRPO-style runs on GSM8K / MATH-500 with 0.6B-14B models) are
not the textbook sigmoid with its inflection mid-run: they rise fastest before their first
evaluation, evaluate every few steps on a fixed problem set (500 or 1,319 problems: binomial
noise), drift between checkpoints beyond that sampling noise, and some peak and decline. Each
family below draws runs of that kind with a known truth; every run has a step-0 eval (R0,
with the same sampling noise) and evals at equal step intervals (compute proportional to
steps).

Families (name: what varies):
- early: the first eval is already past the inflection (C_mid at 20-90% of the first eval's
  compute), 10-15 evals ("early") or 30-60 ("early-long");
- mid: the inflection inside the data (C_mid at 10-35% of the run), 10-15 / 30-60 evals;
- plateau: the run has all but converged by its first eval (C_mid at 2-10% of it);
- decline: an early run that peaks at 50-75% of its compute and then loses 0.03-0.15 by its
  last eval (linearly in compute), 15-60 evals.
Noise: binomial from an eval set of 500 or 1,319 problems (drawn per run) plus a drift of the
policy's true pass rate between checkpoints, AR(1) along the run with coefficient 0, 0.5 or
0.8 and sd 0.01 (drawn per run: "drift" in the table is the mix).

Per family it prints: how often A and B / C_mid are reported identified, how often A is bounded
below only (its profile likelihood: `a_lower`) and how often that bound holds, the half-run forecast
of the last eval (median |error|, coverage of its 95% interval, median width), the coverage of
A's interval where A is reported identified, and how often the run is called declining (the
true-positive rate on the decline family, the false-positive rate on every other). With
`--no-eval-size` the fitter is not told the eval set's size.
"""

from __future__ import annotations

import argparse
import time
import warnings
import zlib

import numpy as np

from jaxrl_scale.fit import Curve, bootstrap_sigmoid, sigmoid
from jaxrl_scale.fit.decline import detect_decline
from jaxrl_scale.fit.extrapolation import extrapolation_check

FAMILIES = ("early", "early-long", "mid", "mid-long", "plateau", "decline")
DRIFT_SD = 0.01
DRIFT_RHO = (0.0, 0.5, 0.8)
EVAL_SIZES = (500, 1319)


def draw_run(rng, family: str) -> dict:
    """One synthetic run of `family`: compute [P], observed rates [P], observed R0, eval size,
    the truth (A, B, C_mid, R0) and the expected rate at the last eval (mean [P])."""
    long = family.endswith("-long") or (family == "decline" and rng.random() < 0.5)
    points = int(rng.integers(30, 61) if long else rng.integers(10, 16))
    if family == "decline":
        points = max(points, 15)
    compute = np.arange(1, points + 1, dtype=float) / points  # evals at equal step intervals
    r0 = rng.uniform(0.1, 0.55)
    a = min(r0 + rng.uniform(0.12, 0.4), 0.95)
    b = rng.uniform(0.8, 2.5)
    first = compute[0]
    if family.startswith("mid"):
        c_mid = rng.uniform(0.1, 0.35)
    elif family == "plateau":
        c_mid = rng.uniform(0.02, 0.1) * first
    else:
        c_mid = rng.uniform(0.2, 0.9) * first
    mean = np.asarray(sigmoid(compute, a, b, c_mid, r0))
    declining = family == "decline"
    peak = drop = None
    if declining:
        peak, drop = rng.uniform(0.5, 0.75), rng.uniform(0.03, 0.15)
        mean = mean - drop * np.clip((compute - peak) / (1 - peak), 0, None)
    size = int(rng.choice(EVAL_SIZES))
    rho = float(rng.choice(DRIFT_RHO))
    drift = np.empty(points)
    drift[0] = DRIFT_SD * rng.standard_normal()
    for t in range(1, points):
        drift[t] = rho * drift[t - 1] + np.sqrt(1 - rho * rho) * DRIFT_SD * rng.standard_normal()
    if rho == 0.0:
        drift[:] = 0.0  # no drift: sampling noise only
    p = np.clip(mean + drift, 0.0, 1.0)
    rates = rng.binomial(size, p) / size
    r0_obs = rng.binomial(size, r0) / size
    return dict(
        compute=compute, rates=rates, r0=r0_obs, eval_size=size, a=a, b=b, c_mid=c_mid,
        true_r0=r0, mean=mean, declining=declining, peak=peak, drop=drop, rho=rho,
    )  # fmt: skip


def score(family: str, runs: int, n_boot: int, use_size: bool) -> dict[str, float]:
    rng = np.random.default_rng(zlib.crc32(family.encode()))
    a_id, bc_id, a_in, f_err, f_in, f_width, called = [], [], [], [], [], [], []
    lower, lower_in = [], []  # A bounded below only (profile likelihood); the bound held
    for i in range(runs):
        run = draw_run(rng, family)
        size = run["eval_size"] if use_size else None
        boot = bootstrap_sigmoid(
            run["compute"], run["rates"], n=n_boot, seed=i, r0=run["r0"], eval_size=size
        )
        ident = boot.identified
        a_id.append(ident["a"])
        bc_id.append(ident["b"] and ident["c_mid"])
        if ident["a"] and not run["declining"]:
            lo, hi = boot.ci["a"]
            a_in.append(lo <= run["a"] <= hi)
        lower.append(boot.a_lower is not None)
        if boot.a_lower is not None and not run["declining"]:
            lower_in.append(boot.a_lower <= run["a"])
        curve = Curve("run", run["compute"], run["rates"])
        called.append(detect_decline(curve, r0=run["r0"], eval_size=size, seed=i) is not None)
        half = extrapolation_check(
            run["compute"], run["rates"], fit_until=0.5, n_boot=n_boot, seed=i, r0=run["r0"],
            eval_size=size,
        )  # fmt: skip
        f_err.append(abs(half.error))
        f_in.append(half.covered)
        f_width.append(half.hi - half.lo)
    return {
        "a_identified": float(np.mean(a_id)),
        "bc_identified": float(np.mean(bc_id)),
        "a_cover": float(np.mean(a_in)) if a_in else float("nan"),
        "a_lower": float(np.mean(lower)),
        "lower_cover": float(np.mean(lower_in)) if lower_in else float("nan"),
        "f_err": float(np.median(f_err)),
        "f_cover": float(np.mean(f_in)),
        "f_width": float(np.nanmedian(f_width)),
        "declining": float(np.mean(called)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--boot", type=int, default=400)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--no-eval-size", action="store_true", help="do not tell the eval size")
    args = parser.parse_args()
    print(
        f"{args.runs} runs per family, {args.boot} resamples, nominal 95%, eval size "
        f"{'not ' if args.no_eval_size else ''}given; forecast: the last eval from the first "
        "half of the compute (interval for the observed eval)"
    )
    print(
        f"{'family':<12}{'A ident':>9}{'B/Cmid id':>11}{'A cover':>9}{'A >= lo':>9}"
        f"{'lo holds':>10}{'fcst |err|':>12}{'fcst cover':>12}{'fcst width':>12}{'declining':>11}"
    )
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for family in args.families:
            r = score(family, args.runs, args.boot, not args.no_eval_size)
            print(
                f"{family:<12}{r['a_identified']:>9.0%}{r['bc_identified']:>11.0%}"
                f"{r['a_cover']:>9.1%}{r['a_lower']:>9.0%}{r['lower_cover']:>10.1%}"
                f"{r['f_err']:>12.3f}{r['f_cover']:>12.1%}"
                f"{r['f_width']:>12.3f}{r['declining']:>11.1%}",
                flush=True,
            )
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
