"""Forecasts on public RL training curves: half-run forecasts, verdicts and declines.

    python benchmarks/bench_real_curves.py [--boot 1000] [--min-points 6]

The curves are benchmarks/data/real_curves.json: held-out accuracy at several steps of one
run each, copied from public repositories (each curve names its file, commit and table; see
that file's `how`). Compute is taken proportional to steps; an eval at step 0 is R0 (measured
before RL), else R0 is fitted. The fitter is told each eval's size where the source says it.

Per curve it prints: the half-run forecast of the last eval (the curve fitted on the evals
up to half the last step, as `jaxrl-scale fit` and the trainer's forecasts do): predicted,
observed, its 95% interval; the verdict on A from the whole curve (identified, bounded below,
not identified); whether `detect_decline` calls the run declining; and the drop from its
best eval to the mean of its last three where four or more evals follow the best (the
declines a user would want named), in units of the eval's binomial sd.

Then the summary against the goals: median |error| <= 0.02, coverage >= 90%, median width
<= 0.15, neither identified nor bounded on at most a third, every drop of 0.04 or more
named. A drop is only as visible as its eval's noise: on 30 (AIME) or 40 (AMC) problems one
eval's sd is 0.07-0.09, so a 0.1 drop from a single best eval is within noise.

The forecast's interval is for what the last eval measures (the run's rate there plus the
eval's own sampling noise), the interval the trainer's online forecast states and the one
coverage can be checked with. Two more lines say how much of width and error that noise
alone makes: the median width of the interval for the rate itself, and the median |error|
a forecast that knew the rate exactly would still have (0.674 x one eval's binomial sd).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import numpy as np

from jaxrl_scale.fit import Curve, bootstrap_sigmoid
from jaxrl_scale.fit.data import CurveDataError
from jaxrl_scale.fit.decline import detect_decline
from jaxrl_scale.fit.extrapolation import extrapolation_check

DATA = Path(__file__).resolve().parent / "data" / "real_curves.json"
DROP = 0.04  # the decline: at least this far below the best eval
AFTER = 4  # ... shown by at least this many evals after it


def load(min_points: int) -> list[dict]:
    curves = json.loads(DATA.read_text())["curves"]
    return [c for c in curves if len(c["points"]) >= min_points]


def prepare(curve: dict) -> dict:
    """compute (steps / last step) and rewards after step 0, R0 (the step-0 eval) or None,
    the eval size (problems x samples) or None."""
    x, y = (np.asarray(v, float) for v in zip(*curve["points"], strict=True))
    r0 = None
    if x[0] == 0:
        r0, x, y = float(y[0]), x[1:], y[1:]
    n = curve.get("eval_n")
    size = int(n * (curve.get("samples_per_problem") or 1)) if n else None
    return {"compute": x / x[-1], "rates": y, "r0": r0, "size": size}


def observed_drop(rates: np.ndarray) -> float | None:
    """The best eval minus the mean of the last three, where at least AFTER evals follow the
    best; None where they do not."""
    best = int(np.argmax(rates))
    if rates.size - 1 - best < AFTER:
        return None
    return float(rates[best] - rates[-3:].mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--boot", type=int, default=1000)
    parser.add_argument("--min-points", type=int, default=6, help="evals after step 0 too")
    args = parser.parse_args()
    curves = load(args.min_points)
    sources = {c["source"].split(" ")[0].split("@")[0] for c in curves}
    print(f"{len(curves)} curves from {len(sources)} sources ({DATA.name}); {args.boot} "
          "resamples, nominal 95%")  # fmt: skip
    head = (f"{'curve':<44}{'n':>5}{'evals':>6}{'fcst':>7}{'obs':>7}{'|err|':>7}"
            f"{'95% interval':>16}{'A verdict':>22}{'drop':>7}{'(sd)':>6}{'named':>7}")  # fmt: skip
    print(head)
    errs, cover, widths, verdicts, named, false_calls, healthy = [], [], [], [], [], 0, 0
    rate_widths, floors = [], []  # the rate's interval; |error| of an exact rate forecast
    too_few = 0
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, c in enumerate(curves):
            d = prepare(c)
            try:
                half = extrapolation_check(d["compute"], d["rates"], fit_until=0.5,
                                           n_boot=args.boot, seed=i, r0=d["r0"],
                                           eval_size=d["size"])  # fmt: skip
            except CurveDataError as e:  # too few evals in the first half to fit
                half, too_few, why = None, too_few + 1, str(e).split(": ", 1)[-1]
            boot = bootstrap_sigmoid(d["compute"], d["rates"], n=args.boot, seed=i, r0=d["r0"],
                                     eval_size=d["size"])  # fmt: skip
            verdict = boot.a_verdict
            if verdict == "lower bound":
                verdict = f"A >= {boot.a_lower:.3f}"
            called = detect_decline(Curve(c["name"], d["compute"], d["rates"]), r0=d["r0"],
                                    eval_size=d["size"], seed=i) is not None  # fmt: skip
            drop = observed_drop(d["rates"])
            sd = None
            if drop is not None and d["size"]:
                p = float(d["rates"].max())
                sd = drop / np.sqrt(p * (1 - p) / d["size"])
            if drop is not None and drop >= DROP:
                named.append(called)
            else:
                healthy += 1
                false_calls += called
            verdicts.append(boot.a_verdict)
            if half is None:
                print(f"{c['name'][:43]:<44}{d['size'] or '-':>5}{d['rates'].size:>6}"
                      f"  no half-run forecast ({why}){verdict:>22}")  # fmt: skip
                continue
            errs.append(abs(half.error))
            cover.append(half.covered)  # an interval that could not be made covers nothing
            widths.append(half.hi - half.lo if np.isfinite(half.hi - half.lo) else np.inf)
            lo, _, hi = (float(np.asarray(v)) for v in half.boot.predict_ci(half.c_last))
            rate_widths.append(hi - lo if np.isfinite(hi - lo) else np.inf)
            if d["size"]:  # the median of |N(0, sd)| is 0.674 sd
                floors.append(0.674 * np.sqrt(half.actual * (1 - half.actual) / d["size"]))
            print(
                f"{c['name'][:43]:<44}{d['size'] or '-':>5}{d['rates'].size:>6}"
                f"{half.predicted:>7.3f}{half.actual:>7.3f}{abs(half.error):>7.3f}"
                f"{f'[{half.lo:.3f}, {half.hi:.3f}]':>16}{verdict:>22}"
                f"{'-' if drop is None else f'{drop:.3f}':>7}"
                f"{'-' if sd is None else f'{sd:.1f}':>6}"
                f"{'yes' if called else 'no':>7}",
                flush=True,
            )  # fmt: skip
    neither = sum(v == "not identified" for v in verdicts) / len(verdicts)
    print(
        f"\nhalf-run forecasts: median |error| {statistics.median(errs):.3f} (goal <= 0.02), "
        f"coverage {np.mean(cover):.0%} (goal >= 90%), median width "
        f"{statistics.median(widths):.3f} (goal <= 0.15; no interval counts as infinite) on "
        f"{len(errs)} curves; {too_few} with too few evals in their first half to fit"
    )
    print(
        f"  of that, the evals' own noise: the interval for the rate at the last step has a "
        f"median width of {statistics.median(rate_widths):.3f}; a forecast of the exact rate "
        f"would miss the observed eval by a median of {statistics.median(floors):.3f} "
        f"({len(floors)} curves with a known eval size)"
    )
    print(
        f"A: identified {sum(v == 'identified' for v in verdicts)}, bounded below "
        f"{sum(v == 'lower bound' for v in verdicts)}, neither {neither:.0%} of "
        f"{len(verdicts)} (goal <= 33%)"
    )
    print(
        f"declines of {DROP} or more after {AFTER}+ evals: {sum(named)} of {len(named)} named; "
        f"runs called declining without such a drop: {false_calls} of {healthy}"
    )
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
