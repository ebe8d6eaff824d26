"""Do the 95% intervals cover 95%? Coverage and width on synthetic learning curves.

    python benchmarks/bench_calibration.py [--curves 200] [--boot 500] [--methods pairs block]

Each row is one noise model and one curve length; each curve has a known truth: A in
[0.55, 0.9], R0 in [0.2, 0.4], B in [1.2, 2.5], C_mid at 15-35% of the run's compute, and
evaluations at equal compute intervals (an eval every N steps), R0 held at the step-0 eval
(which carries the same noise). Noise (total sd 0.015):

- independent: every eval's error drawn afresh;
- AR(1) phi: errors correlated along the run (successive checkpoints drift together);
- transient: independent noise plus an early transient the sigmoid does not describe (a
  quick early gain of 0.03-0.10 that fades with compute scale 2-6% of the run, as when a
  policy first learns the answer format);
- run offset: one offset for the whole run (sd 0.015) plus independent noise (sd 0.01). The
  run's own ceiling is A + offset: "this run's A" covers it, the recipe's A is A itself, which
  no interval from one run can be expected to cover (that is what several seeds are for).

For every method it prints the coverage of the 95% interval for A (this run's ceiling) and
its median width, and the coverage and median width of the half-run forecast of the final
eval (fit on the first half of the compute, interval for the observed last point). Curves
whose fit is not identifiable still count: their intervals are what a user would read.
With `--seeds S` (S > 1) every curve gets S - 1 more seeds (the same truth, fresh noise and
offset) and the row adds the coverage and width of the recipe's interval (fit.recipe) for
the recipe's A, which no single run's interval is meant to cover under a run offset.
"""

from __future__ import annotations

import argparse
import time
import warnings
import zlib

import numpy as np

from jaxrl_scale.fit import bootstrap_sigmoid, sigmoid
from jaxrl_scale.fit.extrapolation import early_cut, extrapolation_check
from jaxrl_scale.fit.recipe import recipe_ceiling

SD = 0.015


def noise(rng, model: str, n: int) -> tuple[np.ndarray, float]:
    """(errors [n] along the run, the run-level offset in them)."""
    if model == "independent":
        return SD * rng.standard_normal(n), 0.0
    if model.startswith("ar"):
        phi = float(model[2:])
        e = np.empty(n)
        e[0] = SD * rng.standard_normal()
        for t in range(1, n):
            e[t] = phi * e[t - 1] + np.sqrt(1 - phi**2) * SD * rng.standard_normal()
        return e, 0.0
    if model == "transient":
        return SD * rng.standard_normal(n), 0.0  # the transient itself is added in curve()
    if model == "offset":
        offset = SD * rng.standard_normal()
        return offset + 0.01 * rng.standard_normal(n), offset
    raise ValueError(model)


def truth(rng) -> tuple[float, float, float, float]:
    """(A, B, C_mid, R0) of one recipe."""
    a, r0, b = rng.uniform(0.55, 0.9), rng.uniform(0.2, 0.4), rng.uniform(1.2, 2.5)
    return a, b, rng.uniform(0.15, 0.35), r0


def curve(rng, model: str, points: int, recipe=None):
    """(compute [P], observed rates [P], observed R0, the run's true ceiling) of one seed of
    `recipe` (a fresh one when None)."""
    a, b, c_mid, r0 = recipe or truth(rng)
    compute = np.arange(1, points + 1) / points
    errors, offset = noise(rng, model, points + 1)  # errors[0] is the step-0 eval's
    mean = np.asarray(sigmoid(compute, a, b, c_mid, r0))
    if model == "transient":
        height, scale = rng.uniform(0.03, 0.10), rng.uniform(0.02, 0.06)
        mean = mean + height * np.exp(-compute / scale)
    rates = np.clip(mean + errors[1:], 0.0, 1.0)
    return compute, rates, float(np.clip(r0 + errors[0], 0.0, 1.0)), a + offset


def row(
    model: str,
    points: int,
    method: str,
    curves: int,
    n_boot: int,
    seeds: int = 1,
    c_min_fraction: float = 0.0,
) -> dict[str, float]:
    rng = np.random.default_rng([points, zlib.crc32(model.encode())])  # one stream per row
    a_in, a_width, f_in, f_width, ident, r_in, r_width = [], [], [], [], [], [], []
    for i in range(curves):
        recipe = truth(rng)
        compute, rates, r0, run_a = curve(rng, model, points, recipe)
        late = compute >= early_cut(compute, c_min_fraction)
        boot = bootstrap_sigmoid(compute[late], rates[late], n=n_boot, seed=i, r0=r0, method=method)
        lo, hi = boot.ci["a"]
        if seeds > 1:
            fits = [boot]
            for s in range(1, seeds):
                c, y, s_r0, _ = curve(rng, model, points, recipe)
                fits.append(bootstrap_sigmoid(c, y, n=n_boot, seed=i + 7919 * s, r0=s_r0,
                                              method=method))  # fmt: skip
            ok = [f for f in fits if np.isfinite(f.ci["a"]).all()]
            r_lo, r_hi = (np.nan, np.nan)
            if ok:
                rc = recipe_ceiling("r", [float(f.fit.a) for f in ok], [f.ci["a"] for f in ok])
                r_lo, r_hi = rc.ci
            r_in.append(r_lo <= recipe[0] <= r_hi)
            r_width.append(r_hi - r_lo)
        a_in.append(lo <= run_a <= hi)
        a_width.append(hi - lo)
        ident.append(boot.identifiable)
        half = extrapolation_check(
            compute,
            rates,
            fit_until=0.5,
            n_boot=n_boot,
            seed=i,
            r0=r0,
            method=method,
            c_min_fraction=c_min_fraction,
        )
        f_in.append(half.covered)
        f_width.append(half.hi - half.lo)
    return {
        "a_cover": float(np.mean(a_in)),
        "a_width": float(np.nanmedian(a_width)),
        "f_cover": float(np.mean(f_in)),
        "f_width": float(np.nanmedian(f_width)),
        "identifiable": float(np.mean(ident)),
        "r_cover": float(np.mean(r_in)) if r_in else float("nan"),
        "r_width": float(np.nanmedian(r_width)) if r_width else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--curves", type=int, default=200)
    parser.add_argument("--boot", type=int, default=500)
    parser.add_argument("--methods", nargs="+", default=["auto", "pairs", "block", "residual"])
    parser.add_argument("--models", nargs="+", default=["independent", "ar0.5", "ar0.8", "offset"])
    parser.add_argument("--points", nargs="+", type=int, default=[10, 30])
    parser.add_argument("--c-min-fraction", type=float, default=0.0, help="early cut-off")
    parser.add_argument("--seeds", type=int, default=1, help="seeds per recipe (> 1: recipe A)")
    args = parser.parse_args()
    print(
        f"{args.curves} curves per row, {args.boot} resamples per interval, nominal 95%; "
        "A: this run's ceiling; forecast: the final eval from the first half of the compute"
    )
    print(
        f"{'noise':<12}{'P':>4}  {'method':<9}{'A cover':>9}{'A width':>9}"
        f"{'fcst cover':>12}{'fcst width':>12}{'identif.':>10}"
        + (f"{'recipe cover':>14}{'recipe width':>14}" if args.seeds > 1 else "")
    )
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model in args.models:
            for points in args.points:
                for method in args.methods:
                    r = row(
                        model,
                        points,
                        method,
                        args.curves,
                        args.boot,
                        args.seeds,
                        args.c_min_fraction,
                    )
                    recipe = f"{r['r_cover']:>14.1%}{r['r_width']:>14.3f}" if args.seeds > 1 else ""
                    print(
                        f"{model:<12}{points:>4}  {method:<9}{r['a_cover']:>9.1%}"
                        f"{r['a_width']:>9.3f}{r['f_cover']:>12.1%}{r['f_width']:>12.3f}"
                        f"{r['identifiable']:>10.0%}{recipe}",
                        flush=True,
                    )
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
