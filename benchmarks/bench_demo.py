"""The demo against its goals: time, RL gain, width of A's interval, half-run forecast error.

    python benchmarks/bench_demo.py [--out runs/bench_demo]

Runs `jaxrl-scale demo` as shipped (jaxrl_scale/assets/demo.yaml from the shipped policy) and
prints each measured number beside its goal (issue 7): wall time <= 600 s after install, held-
out gain over RL >= 0.2, 95% interval of A no wider than 0.15, the fit at half the run within
0.05 of the final pass rate. About 4 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from jaxrl_scale.config import load_config
from jaxrl_scale.demo import run_demo

CONFIG = "asset:demo.yaml"  # jaxrl_scale/assets/demo.yaml


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_demo"))
    args = parser.parse_args()
    start = time.perf_counter()
    s = run_demo(load_config(CONFIG), args.out)
    wall = time.perf_counter() - start
    a_lo, a_hi = s["a_ci"]
    checks = [
        ("wall time, s", wall, "<= 600", wall <= 600),
        ("held-out gain over RL", s["gain"], ">= 0.2", s["gain"] >= 0.2),
        ("width of A's 95% interval", a_hi - a_lo, "<= 0.15", a_hi - a_lo <= 0.15),
        (
            "half-run forecast error",
            abs(s["half_run"]["error"]),
            "<= 0.05",
            abs(s["half_run"]["error"]) <= 0.05,
        ),
    ]
    print(f"\n{'measure':<28}{'value':>10}  {'goal':<8} met")
    for name, value, goal, ok in checks:
        print(f"{name:<28}{value:>10.3f}  {goal:<8} {'yes' if ok else 'NO'}")


if __name__ == "__main__":
    main()
