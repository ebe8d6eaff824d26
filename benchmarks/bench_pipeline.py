"""RL step throughput: `sync` vs `pipeline_rl` (k = 8; a generator thread, and in lockstep)
on the same workload.

    python benchmarks/bench_pipeline.py [--steps 24] [--set sampler.batching=continuous]
    python benchmarks/bench_pipeline.py --qwen05b    # on an accelerator (8 steps)

Workload (the peer figure's): a Qwen3-shaped model of ~0.54M parameters (vocab 64, d_model 128,
2 layers, 4 heads, ffn 512), 64 prompts x 16 samples, 8-token prompts, up to 16-token
completions, CISPO. Prints samples/s, seconds per RL step and the trainer's idle fraction per
mode, and the ratios to `sync` measured in the same invocation. The first two steps
(compilation) are not timed. The window must be long next to k: a threaded generator makes up
to k batches while the trainer compiles, and with 8 steps and k = 8 those dominated the window
(docs/benchmarks.md); 24 steps are the default.

The peer's figure (tunix 0.1.7 GRPO on this workload, 602 samples/s on 2026-11-22, 329 on
2026-11-23 on the same machine type) is in docs/benchmarks.md: a constant measured on another
day is not a ratio this script can print.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from bench_model import PEAK_BF16

from jaxrl_scale.config import load_config
from jaxrl_scale.train import setup, train_run

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
    "warm_start.steps=0",
    "train.eval_every=0",
    "task.num_eval=8",
    "train.eval_samples=1",
    "checkpoint.every=0",
    "mesh.data=1",
]


MODES = {
    "sync": ["pipeline.mode=sync"],
    "pipeline_rl": ["pipeline.mode=pipeline_rl"],
    "lockstep": ["pipeline.mode=pipeline_rl", "pipeline.lockstep=true"],
}


# A Qwen2.5-0.5B-shaped random model (bf16, FP32 head) on the arithmetic prompts: for an
# accelerator. Random weights rarely emit EOS, so completions run to max_new_tokens.
QWEN05B = [
    "model.architecture=qwen2",
    "model.vocab_size=151936",
    "model.hidden_size=896",
    "model.intermediate_size=4864",
    "model.num_layers=24",
    "model.num_heads=14",
    "model.num_kv_heads=2",
    "model.rope_theta=1000000.0",
    "model.qkv_bias=true",
    "model.tie_embeddings=true",
    "model.dtype=bfloat16",
    "model.lm_head_dtype=float32",
    "model.logits_chunk_size=512",
    "train.prompts_per_step=32",
    "train.group_size=16",
    "sampler.max_new_tokens=512",
    "sampler.chunk_size=64",
    "warm_start.steps=0",
    "train.eval_every=0",
    "task.num_eval=8",
    "train.eval_samples=1",
    "checkpoint.every=0",
    "mesh.data=-1",
]


def run(mode: str, steps: int, workload: list[str], train_repeats: int = 0) -> dict[str, float]:
    cfg = load_config(CONFIG, [*workload, *MODES[mode], f"train.steps={steps}"])
    with tempfile.TemporaryDirectory() as out:
        run = setup(cfg, out, resume=False)
        train_step = _time_train_step(run, train_repeats) if train_repeats else {}
        rows = train_run(run)
    timed = rows[3:-1]  # skip step 0 (eval), the compile steps 1-2 and the final eval step
    # RL-loop seconds without evaluations and compiles (the x-axis clock), per device.
    clock = [r["device_seconds"] / run.devices for r in rows]
    seconds = (clock[-2] - clock[2]) / len(timed)
    batch = cfg.train.prompts_per_step * cfg.train.group_size
    return {
        "samples_per_s": batch / seconds,
        "tokens_per_s": float(np.mean([r["gen_length_mean"] for r in timed])) * batch / seconds,
        "step_s": seconds,
        "idle": float(np.mean([r["trainer_idle_fraction"] for r in timed])),
        "gen_len": float(np.mean([r["gen_length_mean"] for r in timed])),
        "staleness_max": max(r["staleness_max"] for r in rows),
        **train_step,
    }


def _time_train_step(run, repeats: int) -> dict[str, float]:
    """The train step alone on one fresh batch: seconds, and model FLOP/s by the analytic count
    the metrics use (compute.py)."""
    frozen = (run.start.step, run.start.train.params)
    ro = run.worker.rollouts(lambda chunk: frozen, jax.random.key(1))
    state = jax.tree.map(jnp.copy, run.start.train)  # the run's own state stays undonated
    state, metrics = run.train_step(state, ro.batch)  # warm
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(repeats):
        state, metrics = run.train_step(state, ro.batch)
    jax.block_until_ready(metrics)
    seconds = (time.perf_counter() - start) / repeats
    flops = ro.stats["train_flops"] / seconds
    peak = PEAK_BF16.get(jax.devices()[0].device_kind)
    return {"train_step_s": seconds, "train_flops_per_s": flops, "mfu": flops / peak if peak else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=None, help="RL steps (24; --qwen05b 8)")
    parser.add_argument(
        "--qwen05b",
        action="store_true",
        help="a Qwen2.5-0.5B-shaped random model (for an accelerator): step time, tokens/s, "
        "train-step MFU",
    )
    parser.add_argument("--set", action="append", default=[], help="extra config overrides")
    args = parser.parse_args()
    if args.qwen05b:
        qwen(args.steps or 8, [*QWEN05B, *args.set])
        return
    results = {mode: run(mode, args.steps or 24, [*WORKLOAD, *args.set]) for mode in MODES}
    print("workload: Qwen3-shaped 0.54M params, 64 prompts x 16 samples, 16 new tokens, CISPO")
    print(
        f"{'mode':<13}{'samples/s':>11}{'s/step':>9}{'trainer idle':>14}"
        f"{'gen len':>9}{'max stale':>11}{'x sync':>8}"
    )
    for mode, r in results.items():
        print(
            f"{mode:<13}{r['samples_per_s']:>11,.0f}{r['step_s']:>9.3f}{r['idle']:>14.1%}"
            f"{r['gen_len']:>9.1f}{r['staleness_max']:>11}"
            f"{r['samples_per_s'] / results['sync']['samples_per_s']:>8.2f}"
        )
    ratio = results["pipeline_rl"]["samples_per_s"] / results["sync"]["samples_per_s"]
    print(f"ratio pipeline_rl / sync: {ratio:.2f}x")


def qwen(steps: int, workload: list[str]) -> None:
    device = jax.devices()[0]
    print(f"device: {device.device_kind} x{jax.device_count()} ({jax.default_backend()})")
    cfg = load_config(CONFIG, workload)
    print(
        f"workload: Qwen2.5-0.5B shape ({cfg.model.num_layers} layers, d {cfg.model.hidden_size},"
        f" vocab {cfg.model.vocab_size}), random weights, {cfg.model.dtype} + "
        f"{cfg.model.lm_head_dtype} head; {cfg.train.prompts_per_step} prompts x "
        f"{cfg.train.group_size}, up to {cfg.sampler.max_new_tokens} new tokens"
    )
    print(
        f"{'mode':<13}{'s/step':>9}{'gen tokens/s':>14}{'train step s':>14}{'TFLOP/s':>9}{'MFU':>7}"
    )
    for mode in ("sync", "pipeline_rl"):
        r = run(mode, steps, workload, train_repeats=3)
        mfu = f"{r['mfu']:.1%}" if r["mfu"] else "-"
        print(
            f"{mode:<13}{r['step_s']:>9.2f}{r['tokens_per_s']:>14,.0f}{r['train_step_s']:>14.3f}"
            f"{r['train_flops_per_s'] / 1e12:>9.1f}{mfu:>7}"
        )


if __name__ == "__main__":
    main()
