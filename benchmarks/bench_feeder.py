"""PipelineRL-k's bound under a fast generator: batches generated, trained, dropped; staleness.

    python benchmarks/bench_feeder.py [--steps 200] [--ratio 5]

A simulation with no model: the producer takes `1 / ratio` of a train step per batch (two
decode chunks, reading the newest parameters before each, as the real generator does), the
trainer sleeps one step per batch. Prints, for k = 1, 2, 8: batches generated, trained and
dropped, the staleness histogram of trained batches, and the fraction of the trainer's time
spent waiting for a batch (after the first). With the generator gated (it starts batch n
only after n - k published updates) nothing is dropped; the earlier feeder, which only
blocked on a full buffer, dropped 99 / 66 / 21 batches at k = 1 / 2 / 8 in the same 200
steps (2026-11-23).
"""

from __future__ import annotations

import argparse
import collections
import time

import jax
import numpy as np

from jaxrl_scale.rl.pipeline import ParamsSource, PipelineFeeder


class _Batch:
    def __init__(self, versions):
        self.versions = np.asarray(versions)


def simulate(k: int, steps: int, step_seconds: float, ratio: float) -> dict:
    produced = [0]

    def produce(params_for_chunk, key, *, oldest):
        versions = []
        for chunk in range(2):
            versions.append(params_for_chunk(chunk)[0])
            time.sleep(step_seconds / ratio / 2)
        produced[0] += 1
        return _Batch([versions])

    version = [0]
    feeder = PipelineFeeder(produce, ParamsSource(0, None), jax.random.key(0), k=k, version=0)
    lags, waited = collections.Counter(), 0.0
    try:
        for i in range(steps):
            t = time.perf_counter()
            batch = feeder.next()
            if i == 0:  # the first batch includes thread start-up and compiling fold_in
                start = time.perf_counter()
            else:
                waited += time.perf_counter() - t
            lags[version[0] - int(batch.versions.min())] += 1
            time.sleep(step_seconds)
            version[0] += 1
            feeder.trained(None, version[0])
    finally:
        feeder.stop()
    wall = time.perf_counter() - start
    return {
        "generated": produced[0],
        "trained": steps,
        "dropped": len(feeder.take_dropped()),
        "lags": dict(sorted(lags.items())),
        "wait": waited / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ratio", type=float, default=5.0, help="generator speed / trainer's")
    parser.add_argument("--step-ms", type=float, default=10.0)
    args = parser.parse_args()
    print(f"# generator {args.ratio:g}x the trainer's speed, {args.steps} train steps")
    print(f"{'k':>3}{'generated':>11}{'trained':>9}{'dropped':>9}{'trainer waits':>15}  staleness")
    for k in (1, 2, 8):
        r = simulate(k, args.steps, args.step_ms / 1000, args.ratio)
        print(
            f"{k:>3}{r['generated']:>11}{r['trained']:>9}{r['dropped']:>9}"
            f"{r['wait']:>14.1%}  {r['lags']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
