"""Is the shared-ceiling comparison's verdict calibrated? False positives and power.

    python benchmarks/bench_comparison.py [--pairs 200] [--boot 400] [--methods auto pairs]

Each pair is two runs of one recipe drawn as in bench_calibration.py (A in [0.55, 0.9], R0 in
[0.2, 0.4], B in [1.2, 2.5], C_mid at 15-35% of the run's compute; 20 evals at equal compute
intervals; R0 held at the step-0 eval, which carries the same noise; noise sd 0.015,
independent or AR(1) along the run), each with its own noise. `shared_ceiling` calls a pair
"distinguishable" when its 95% interval for B[0] - B[1] excludes 0: for two runs of one recipe
that is a false positive, which a calibrated test makes about 5% of the time. Power: the same
recipe but the second run's B multiplied by a factor (A, C_mid and R0 unchanged). Each rate
comes with its binomial standard error.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_calibration import curve, truth  # noqa: E402

from jaxrl_scale.fit import clean_curve, shared_ceiling  # noqa: E402

POINTS = 20


def pair(rng, model: str, factor: float):
    """Two runs of one recipe, the second's B multiplied by `factor`."""
    a, b, c_mid, r0 = truth(rng)
    runs = []
    for name, f in (("first", 1.0), ("second", factor)):
        compute, rates, step0, _ = curve(rng, model, POINTS, (a, b * f, c_mid, r0))
        runs.append(dataclasses.replace(clean_curve(compute, rates, name=name), r0=step0))
    return runs


def rate(model: str, factor: float, method: str, pairs: int, n_boot: int) -> tuple[float, float]:
    """(fraction of pairs called distinguishable, its standard error); every method sees the
    same pairs."""
    rng = np.random.default_rng([zlib.crc32(model.encode()), round(100 * factor)])
    hits = [
        shared_ceiling(
            *pair(rng, model, factor), n_boot=n_boot, seed=i, method=method
        ).distinguishable
        for i in range(pairs)
    ]
    p = float(np.mean(hits))
    return p, float(np.sqrt(p * (1 - p) / pairs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--boot", type=int, default=400)
    parser.add_argument("--methods", nargs="+", default=["auto", "pairs"])
    parser.add_argument("--models", nargs="+", default=["independent", "ar0.5", "ar0.8"])
    parser.add_argument("--factors", nargs="+", type=float, default=[1.5, 2.0])
    args = parser.parse_args()
    print("python " + " ".join(sys.argv))
    print(
        f"{args.pairs} pairs per cell, {args.boot} resamples per run, {POINTS} evals per run, "
        "95% interval; rate of 'distinguishable' +- its standard error"
    )
    columns = ["same B"] + [f"B x{f:g}" for f in args.factors]
    print(f"{'noise':<13}{'method':<8}" + "".join(f"{c:>16}" for c in columns))
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model in args.models:
            for method in args.methods:
                cells = [
                    rate(model, f, method, args.pairs, args.boot) for f in [1.0, *args.factors]
                ]
                row = "".join(f"{f'{p:.1%} +- {se:.1%}':>16}" for p, se in cells)
                print(f"{model:<13}{method:<8}{row}", flush=True)
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
