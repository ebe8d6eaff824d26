"""Train-step memory against sequence length at 8B, and the tiny train step's CPU time.

    python benchmarks/bench_memory.py                 # both parts (about 5 minutes on 2 cores)
    python benchmarks/bench_memory.py --part memory   # the 8B memory curve only
    python benchmarks/bench_memory.py --part step     # the tiny step time only
    python benchmarks/bench_memory.py --part admission  # the engine's admission at 4/8/16 devices

memory: per-device bytes of the compiled train step (`jaxrl-scale memory`'s number) of the
Qwen3-8B recipe (configs/scalerl_qwen3-8b_math.yaml: bf16, FP32 head, remat full, scanned
layers, blockwise attention, one prompt group per micro-batch) with FSDP over 8 devices (fake
CPU devices, nothing allocated) at T = 2k ... 32k tokens (256 prompt + T - 256 new). Prints each
T's total and temporaries, the 16k / 4k ratio (linear: 4x, quadratic: 16x; the goal is <= 6x)
and whether 16k fits in 80 GiB.

admission: per-device temporaries of the slot engine's admission program (prefill + write into
the slots) at the 8B recipe's shape, 8 slots per generator device, on 4, 8 and 16 devices; each
device prefills only the prompts its own slots take, so the 16 / 4 ratio should be about 1.

step: the median wall time of the tiny config's compiled train step (configs/tiny_arithmetic.yaml
shapes, synthetic rows), using only APIs that predate this benchmark, so the same command run
against an older checkout (PYTHONPATH=that/checkout) gives the "before" number.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=16")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

GIB = 2**30
LENGTHS = (2048, 4096, 8192, 16384, 32768)
PROMPT = 256


def memory_curve(config: str, lengths=LENGTHS) -> dict[int, dict]:
    from jaxrl_scale.config import load_config
    from jaxrl_scale.memory.train_step import train_step_memory
    from jaxrl_scale.parallel import sharding

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


def admission_curve(config: str, devices=(4, 8, 16), prompt_len: int = 1024) -> dict:
    """Per-device temporaries of the engine's admission at each device count (8 slots each),
    for the config's dtype as the CPU compiles it and for the float32 program (the planner's
    two upper bounds: the CPU compiles bf16 matmuls on float32 copies of their operands)."""
    import dataclasses

    from flax import nnx

    from jaxrl_scale.config import MeshConfig, load_config
    from jaxrl_scale.memory.generator import _interruption
    from jaxrl_scale.models.policy import Policy, for_generation
    from jaxrl_scale.parallel import sharding
    from jaxrl_scale.rl.generator import engine

    base = load_config(config)
    out = {}
    for dtype in dict.fromkeys((base.model.dtype, "float32")):
        model_cfg = dataclasses.replace(base.model, dtype=dtype)
        for n in devices:
            mesh = sharding.make_mesh(MeshConfig(data=n, fsdp=1, tensor=1), jax.devices()[:n])
            abstract = nnx.eval_shape(lambda m=model_cfg: Policy(m, rngs=nnx.Rngs(0)))
            graphdef, state = nnx.split(abstract)
            state = jax.eval_shape(lambda s, m=model_cfg: for_generation(s, m, copy=False), state)
            params = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                state,
                sharding.state_shardings(state, mesh),
            )
            slots = engine.abstract_slots(
                model_cfg, 8 * n, prompt_len, base.sampler.max_new_tokens, mesh
            )
            compiled = engine.lower_admission(
                graphdef, params, slots, repeat=base.train.group_size, prompt_len=prompt_len,
                n_new=base.sampler.max_new_tokens, interruption=_interruption(base), mesh=mesh,
            ).compile()  # fmt: skip
            out[dtype, n] = compiled.memory_analysis().temp_size_in_bytes
            print(f"{dtype:>8}, {n:>2} generator devices ({8 * n} slots): admission "
                  f"temporaries {out[dtype, n] / GIB:.2f} GiB per device", flush=True)  # fmt: skip
    return out


def tiny_step_seconds(repeats: int = 40) -> float:
    from flax import nnx

    from jaxrl_scale.config import LossConfig, load_config
    from jaxrl_scale.models.policy import Policy
    from jaxrl_scale.rl.step import Batch, compile_train_step, init_train_state, make_optimizer

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
    parser.add_argument("--part", choices=["memory", "step", "admission", "both"], default="both")
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
    if args.part == "admission":
        curve = admission_curve(args.config)
        for dtype in dict.fromkeys(d for d, _ in curve):
            ratio = curve[dtype, 16] / curve[dtype, 4]
            print(f"{dtype} admission temporaries per device, 16 / 4 devices: {ratio:.2f}x "
                  "(flat: 1.0; goal: within 10%)")  # fmt: skip
    if args.part in ("step", "both"):
        print(f"tiny train step (CPU, median of 40): {tiny_step_seconds() * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
