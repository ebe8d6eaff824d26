"""Train-step memory against sequence length at 8B, and the tiny train step's CPU time.

    python benchmarks/bench_memory.py                 # both parts (about 5 minutes on 2 cores)
    python benchmarks/bench_memory.py --part memory   # the 8B memory curve only
    python benchmarks/bench_memory.py --part step     # the tiny step time only

memory: per-device bytes of the compiled train step (`jaxrl-scale memory`'s number) of the
Qwen3-8B recipe (configs/scalerl_qwen3-8b_math.yaml: bf16, FP32 head, remat full, scanned
layers, blockwise attention, one prompt group per micro-batch) with FSDP over 8 devices (fake
CPU devices, nothing allocated) at T = 2k ... 32k tokens (256 prompt + T - 256 new). Prints each
T's total and temporaries, the 16k / 4k ratio (linear: 4x, quadratic: 16x; the goal is <= 6x)
and whether 16k fits in 80 GiB.

step: the median wall time of the tiny config's compiled train step (configs/tiny_arithmetic.yaml
shapes, synthetic rows), using only APIs that predate this benchmark, so the same command run
against an older checkout (PYTHONPATH=that/checkout) gives the "before" number.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

GIB = 2**30
LENGTHS = (2048, 4096, 8192, 16384, 32768)
PROMPT = 256


def memory_curve(config: str, lengths=LENGTHS) -> dict[int, dict]:
    from jaxrl_scale import sharding
    from jaxrl_scale.config import load_config
    from jaxrl_scale.memory import train_step_memory

    out = {}
    for t in lengths:
        cfg = load_config(
            config,
            [
                "mesh.data=1",
                "mesh.fsdp=8",
                "mesh.tensor=1",
                "pipeline.generator_devices=0",
                "sampler.interruption=null",
                f"sampler.max_new_tokens={t - PROMPT}",
            ],
        )
        mesh, _ = sharding.make_meshes(cfg)
        start = time.perf_counter()
        out[t] = train_step_memory(cfg, mesh, PROMPT)
        out[t]["compile_s"] = time.perf_counter() - start
        r = out[t]
        print(
            f"T={t:>6,}: per device {r['per_device_bytes'] / GIB:7.2f} GiB "
            f"(temporaries {r['temporaries_bytes'] / GIB:6.2f}, arguments "
            f"{r['arguments_bytes'] / GIB:5.2f}); compiled in {r['compile_s']:.0f} s",
            flush=True,
        )
    return out


def tiny_step_seconds(repeats: int = 40) -> float:
    from flax import nnx

    from jaxrl_scale.config import LossConfig, load_config
    from jaxrl_scale.model import Policy
    from jaxrl_scale.step import Batch, compile_train_step, init_train_state, make_optimizer

    cfg = load_config("configs/tiny_arithmetic.yaml", ["mesh.data=1"])
    p, g = cfg.train.prompts_per_step, cfg.train.group_size
    rows, length, n = p * g, 8, cfg.sampler.max_new_tokens
    model = Policy(cfg.model, rngs=nnx.Rngs(params=0))
    graphdef, params = nnx.split(model)
    tx = make_optimizer(cfg.optim, total_steps=100)
    step = compile_train_step(
        graphdef, tx, group_size=g, loss_cfg=LossConfig(), temperature=1.0, micro_batches=1
    )
    rng = np.random.default_rng(0)
    prompt = np.repeat(rng.integers(1, cfg.model.vocab_size, (p, length)), g, axis=0)
    batch = Batch(
        prompt_tokens=jnp.asarray(prompt, jnp.int32),
        prompt_mask=jnp.ones((rows, length), bool),
        tokens=jnp.asarray(rng.integers(1, cfg.model.vocab_size, (rows, n)), jnp.int32),
        mask=jnp.ones((rows, n), bool),
        loss_mask=jnp.ones((rows, n), jnp.float32),
        behavior_logp=jnp.full((rows, n), -2.0, jnp.float32),
        adv=jnp.asarray(rng.normal(size=rows), jnp.float32),
    )
    state = init_train_state(params, tx)
    state, metrics = step(state, batch)  # compile
    jax.block_until_ready(metrics)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["memory", "step", "both"], default="both")
    parser.add_argument("--config", default="configs/scalerl_qwen3-8b_math.yaml")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices")
    if args.part in ("memory", "both"):
        curve = memory_curve(args.config)
        ratio = curve[16384]["per_device_bytes"] / curve[4096]["per_device_bytes"]
        temp = curve[16384]["temporaries_bytes"] / curve[4096]["temporaries_bytes"]
        fits = curve[16384]["per_device_bytes"] <= 80 * GIB
        print(f"16k / 4k per-device memory: {ratio:.2f}x (temporaries {temp:.2f}x; goal <= 6x)")
        print(f"16k fits in 80 GiB: {'yes' if fits else 'NO'}")
    if args.part in ("step", "both"):
        print(f"tiny train step (CPU, median of 40): {tiny_step_seconds() * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
