"""RL step throughput: `sync` vs `pipeline_rl` (k = 8; a generator thread, and in lockstep)
on the same workload.

    python benchmarks/bench_pipeline.py [--steps 8]

Workload (the peer figure's): a Qwen3-shaped model of ~0.54M parameters (vocab 64, d_model 128,
2 layers, 4 heads, ffn 512), 64 prompts x 16 samples, 8-token prompts, up to 16-token
completions, CISPO. Prints samples/s, seconds per RL step and the trainer's idle fraction per
mode, and the ratio. The first two steps (compilation) are not timed.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxrl_scale.config import load_config
from jaxrl_scale.train import Trainer

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny_arithmetic.yaml"
WORKLOAD = [
    "model.architecture=qwen3",
    "model.qk_norm=true",
    "model.qkv_bias=false",
    "model.vocab_size=64",
    "model.hidden_size=128",
    "model.intermediate_size=512",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=4",
    "train.prompts_per_step=64",
    "train.group_size=16",
    "sampler.max_new_tokens=16",
    "sampler.chunk_size=4",
    "train.sft_steps=0",
    "train.eval_every=0",
    "task.num_eval=8",
    "train.eval_samples=1",
    "checkpoint.every=0",
    "mesh.data=1",
]
PEER_SAMPLES_PER_S = 602.0  # tunix 0.1.7 GRPO on this workload and machine, 1.70 s per step


MODES = {
    "sync": ["pipeline.mode=sync"],
    "pipeline_rl": ["pipeline.mode=pipeline_rl"],
    "lockstep": ["pipeline.mode=pipeline_rl", "pipeline.lockstep=true"],
}


def run(mode: str, steps: int) -> dict[str, float]:
    cfg = load_config(CONFIG, [*WORKLOAD, *MODES[mode], f"train.steps={steps}"])
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(cfg, out, resume=False)
        stamps: list[float] = []
        write = trainer.metrics.write

        def stamped(row):
            stamps.append(time.perf_counter())
            write(row)

        trainer.metrics.write = stamped
        rows = trainer.train()
    timed = rows[3:-1]  # skip step 0 (eval), the compile steps 1-2 and the final eval step
    seconds = (stamps[-2] - stamps[2]) / len(timed)
    batch = cfg.train.prompts_per_step * cfg.train.group_size
    return {
        "samples_per_s": batch / seconds,
        "step_s": seconds,
        "idle": float(np.mean([r["trainer_idle_fraction"] for r in timed])),
        "gen_len": float(np.mean([r["gen_length_mean"] for r in timed])),
        "staleness_max": max(r["staleness_max"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    results = {mode: run(mode, args.steps) for mode in MODES}
    print("workload: Qwen3-shaped 0.54M params, 64 prompts x 16 samples, 16 new tokens, CISPO")
    print(
        f"{'mode':<13}{'samples/s':>11}{'s/step':>9}{'trainer idle':>14}"
        f"{'gen len':>9}{'max stale':>11}{'x peer':>8}"
    )
    for mode, r in results.items():
        print(
            f"{mode:<13}{r['samples_per_s']:>11,.0f}{r['step_s']:>9.3f}{r['idle']:>14.1%}"
            f"{r['gen_len']:>9.1f}{r['staleness_max']:>11}"
            f"{r['samples_per_s'] / PEER_SAMPLES_PER_S:>8.2f}"
        )
    ratio = results["pipeline_rl"]["samples_per_s"] / results["sync"]["samples_per_s"]
    print(f"ratio pipeline_rl / sync: {ratio:.2f}x")
    best = max(r["samples_per_s"] for r in results.values())
    print(f"best / peer ({PEER_SAMPLES_PER_S:.0f} samples/s): {best / PEER_SAMPLES_PER_S:.2f}x")


if __name__ == "__main__":
    main()
