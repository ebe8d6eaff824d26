"""Does RL learn? Held-out pass rate before and after RL on the built-in arithmetic task.

    python benchmarks/bench_learning.py [--mode sync pipeline_rl ...] [--seeds 0 1 2]

Runs `configs/tiny_arithmetic.yaml` as shipped (a 0.4M-parameter model, 1-2 digit add/sub, a
pool of 16,384 training problems and 256 held-out ones): a supervised warm start to a target
demonstration loss, then 300 CISPO steps of 64 prompts x 16 samples. Prints, per mode and seed,
the held-out mean@4 pass rate after the warm start and at the end, the gain, and the steps and
seconds of each phase; then the mean gain per mode. A run takes about 4 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

from jaxrl_scale.config import load_config
from jaxrl_scale.rl.warm_start import warm_start
from jaxrl_scale.train import setup, train_run

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny_arithmetic.yaml"


def run(mode: str, seed: int) -> dict[str, float]:
    cfg = load_config(CONFIG, [f"pipeline.mode={mode}", f"seed={seed}", "checkpoint.every=0"])
    with tempfile.TemporaryDirectory() as out:
        run = setup(cfg, out, resume=False)
        start = time.perf_counter()  # the warm start here, timed; then RL from its policy
        w = run.worker
        params, losses = warm_start(
            run.start.train.params, w.graphdef, w.task, cfg.warm_start, seed=cfg.seed
        )
        warm_s = time.perf_counter() - start
        no_warm_start = dataclasses.replace(cfg.warm_start, steps=0)
        run = dataclasses.replace(
            run,
            cfg=dataclasses.replace(run.cfg, warm_start=no_warm_start),
            start=dataclasses.replace(run.start, train=run.new_train_state(params)),
        )
        start = time.perf_counter()
        rows = train_run(run)
        rl_s = time.perf_counter() - start
    evals = [r for r in rows if "eval_pass_rate" in r]
    return {
        "start": evals[0]["eval_pass_rate"],
        "end": evals[-1]["eval_pass_rate"],
        "best": max(r["eval_pass_rate"] for r in evals),
        "warm_s": warm_s,
        "warm_steps": len(losses),
        "rl_s": rl_s,
        "steps": cfg.train.steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--mode",
        nargs="+",
        default=["sync"],
        choices=["sync", "pipeline_rl", "ppo_off_policy"],
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    print("task: arithmetic (1-2 digit +-), 16,384 train / 256 held-out; model 0.4M params")
    print(
        f"{'mode':<16}{'seed':>5}{'warm-start eval':>16}{'final eval':>12}{'gain':>8}"
        f"{'warm steps':>11}{'warm s':>8}{'RL s':>7}{'RL steps':>10}"
    )
    for mode in args.mode:
        gains = []
        for seed in args.seeds:
            r = run(mode, seed)
            gains.append(r["end"] - r["start"])
            print(
                f"{mode:<16}{seed:>5}{r['start']:>16.3f}{r['end']:>12.3f}{gains[-1]:>+8.3f}"
                f"{r['warm_steps']:>11}{r['warm_s']:>8.0f}{r['rl_s']:>7.0f}{r['steps']:>10}",
                flush=True,
            )
        print(f"{mode}: mean held-out gain {sum(gains) / len(gains):+.3f} over {len(gains)} seeds")


if __name__ == "__main__":
    main()
