"""Sandboxed program runs per second: 1-line and CPU-heavy programs, one worker against a pool.

    python benchmarks/bench_sandbox.py [--runs 200] [--heavy-runs 16] [--workers 0]

The code task runs every test of every completion as its own sandboxed process (sandbox.py):
a launcher, namespaces on a root Linux host, a cgroup where one can be made, a seccomp filter,
a fresh interpreter. Prints which cgroups apply and, for each isolation level that works here
(the strongest, and "rlimits" for comparison):
  - programs/s for a 1-line program (`print(1)`: the cost of a run itself), with 1 worker and
    with the pool (`--workers`, 0: one per CPU core);
  - programs/s for a CPU-heavy program (a loop of about 0.2 s), 1 worker and the pool;
  - the same programs started as bare `python -I -S` subprocesses with no isolation, and the
    ratio bare / sandboxed: what the isolation costs.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import subprocess
import sys
import time

from jaxrl_scale.tasks.sandbox import Sandbox, SandboxLimits

ONE_LINE = "print(1)"
HEAVY = "s = 0\nfor i in range(3_000_000):\n    s += i * i % 7\nprint(s)"


def rate(run_batch, n: int) -> float:
    start = time.perf_counter()
    run_batch(n)
    return n / (time.perf_counter() - start)


def bare(program: str, workers: int):
    python = os.path.realpath(sys.executable)
    one = lambda _: subprocess.run([python, "-I", "-S", "-c", program], capture_output=True)  # noqa: E731
    return lambda n: list(cf.ThreadPoolExecutor(workers).map(one, range(n)))


def sandboxed(sandbox: Sandbox, program: str):
    def run_batch(n):
        results = sandbox.run_many([(program, "")] * n)
        bad = [r for r in results if r.status != "ok"]
        assert not bad, bad[0]

    return run_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--heavy-runs", type=int, default=16)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    pool = args.workers or os.cpu_count() or 1
    limits = SandboxLimits(cpu_seconds=10, wall_seconds=30)
    print(f"{os.cpu_count()} CPU cores; pool of {pool} workers")
    with Sandbox(limits, workers=1) as probe:
        strongest = probe.isolation
        print(f"runs' cgroups: {probe.cgroup}")
    for level in dict.fromkeys([strongest, "rlimits"]):
        print(f"\nisolation: {level}")
        for name, program, n in (
            ("1-line", ONE_LINE, args.runs),
            ("CPU-heavy", HEAVY, args.heavy_runs),
        ):
            row = {}
            for workers in (1, pool):
                with Sandbox(limits, isolation=level, allow_unisolated=True, workers=workers) as s:
                    sandboxed(s, program)(2)  # warm the page cache
                    row[workers] = rate(sandboxed(s, program), n)
            plain = rate(bare(program, pool), n)
            print(
                f"  {name:9s}: {row[1]:7.1f} programs/s with 1 worker, {row[pool]:7.1f} with "
                f"{pool} ({row[pool] / row[1]:.2f}x); bare subprocess {plain:7.1f}/s "
                f"(sandboxed / bare {row[pool] / plain:.2f})"
            )


if __name__ == "__main__":
    main()
