"""LoRA against full fine-tuning: one weight update to the generator, and one train step.

    python benchmarks/bench_lora.py [--part update|step|all] [--ranks 1 8 32] [--repeats 3]

update: what one weight update moves to the generator (`RolloutWorker.update_bytes`: the
trainable parameters in the generator's dtypes, `model.for_generation`), full fine-tuning vs
LoRA on every projection, for the Qwen2.5-0.5B and Qwen3-8B recipe shapes (configs/), from
abstract shapes (`jax.eval_shape`; no 8B array exists). Times, on the CPU devices here:
  - copy: the in-process update of a pipeline_rl generator (`to_generator`: `for_generation`
    with a copy, then the adapters merged onto the generator's base copy), blocked on;
  - pull: the update between jobs, the trainer's `WeightServer.publish` (its layout program)
    plus a `WeightClient.pull` over 127.0.0.1 (`jax.experimental.transfer`), in this one
    process: trainer on CPU device 0, generator on device 1.
Full fine-tuning is timed at the 0.5B shape only; at 8B only the adapters are materialised
(their base is not needed to move them), so the 8B LoRA times are measured and the 8B full
time is not. Printed as full / LoRA ratios.

step: one RL train step (CISPO, the 0.5B recipe's loss) at the Qwen2.5-0.5B shape, 4 rows x
64 tokens (16 prompt + 48 completion, one prompt group), full vs LoRA rank 8 (float32 base),
on one CPU device: compile, then `--steps` timed steps. Prints seconds per step, the ratio,
and the optimizer-state bytes of both (AdamW's two moments; abstract, for both shapes).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_scale.config import MeshConfig, ModelConfig, load_config
from jaxrl_scale.hosts.weights import WeightClient, WeightServer
from jaxrl_scale.models.lora import merge_params, split_policy, state_bytes
from jaxrl_scale.models.policy import Policy, for_generation
from jaxrl_scale.parallel import sharding
from jaxrl_scale.rl.step import Batch, compile_train_step, init_train_state, make_optimizer

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "Qwen2.5-0.5B": ROOT / "configs" / "scalerl_qwen2.5-0.5b_math.yaml",
    "Qwen3-8B": ROOT / "configs" / "scalerl_qwen3-8b_math.yaml",
}
MIB = 2**20


def _with_rank(cfg: ModelConfig, rank: int) -> ModelConfig:
    return dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=rank))


def _abstract_split(cfg: ModelConfig):
    """(frozen or None, trainable) as shapes only."""
    return jax.eval_shape(lambda: split_policy(Policy(cfg, rngs=nnx.Rngs(params=0)), cfg)[1:])


def _update_bytes(cfg: ModelConfig, trainable) -> int:
    return state_bytes(jax.eval_shape(lambda p: for_generation(p, cfg), trainable))


def _zeros(abstract):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)


def _generation_zeros(cfg: ModelConfig, state):
    """`state` as the generator holds it (`for_generation`'s dtypes), all zeros."""
    return _zeros(jax.eval_shape(lambda s: for_generation(s, cfg, copy=False), state))


def _time_copy(cfg, params, base, repeats: int) -> float:
    """Seconds of one in-process update: `to_generator`'s copy in a pipeline_rl run."""

    def update():
        return jax.block_until_ready(merge_params(base, for_generation(params, cfg)))

    update()
    start = time.perf_counter()
    for _ in range(repeats):
        update()
    return (time.perf_counter() - start) / repeats


def _time_pull(cfg, params, repeats: int) -> float:
    """Seconds of one update between jobs: publish on device 0, pull onto device 1."""
    devices = jax.devices()
    one = MeshConfig(data=1, fsdp=1, tensor=1)
    mesh, gen_mesh = sharding.make_mesh(one, devices[:1]), sharding.make_mesh(one, devices[1:2])
    params = jax.device_put(params, devices[0])
    server = WeightServer(mesh, cfg, 1, host="127.0.0.1", timeout=600)
    abstract = jax.eval_shape(lambda p: for_generation(p, cfg, copy=False), params)
    client = WeightClient(abstract, sharding.state_shardings(abstract, gen_mesh), gen_mesh,
                          host="127.0.0.1", timeout=600)  # fmt: skip
    try:
        client.connect([server.address])
        server.publish(0, params)  # compiles both re-layouts
        jax.block_until_ready(client.pull(0))
        start = time.perf_counter()
        for version in range(1, repeats + 1):
            server.publish(version, params)
            jax.block_until_ready(client.pull(version))
        return (time.perf_counter() - start) / repeats
    finally:
        client.close()
        server.close()


def update(args) -> None:
    print("one weight update to the generator (generation dtypes: bf16 matrices, fp32 head/norms)")
    for name, path in SHAPES.items():
        cfg = load_config(path).model
        _, full = _abstract_split(cfg)
        full_bytes = _update_bytes(cfg, full)
        measure = name == "Qwen2.5-0.5B"
        times = {}
        if measure:  # the full policy, materialised at 0.5B only
            params = nnx.split(Policy(cfg, rngs=nnx.Rngs(params=0)))[1]
            times["full"] = (_time_copy(cfg, params, None, args.repeats),
                             _time_pull(cfg, params, args.repeats))  # fmt: skip
            del params
        print(f"\n{name}: full {full_bytes / MIB:,.1f} MiB ({len(jax.tree.leaves(full))} leaves)")
        if measure:
            copy_s, pull_s = times["full"]
            print(f"  {'full':<8} copy {copy_s * 1e3:9.1f} ms   pull {pull_s * 1e3:9.1f} ms")
        for rank in args.ranks:
            lcfg = _with_rank(cfg, rank)
            frozen, adapters = _abstract_split(lcfg)
            nbytes = _update_bytes(lcfg, adapters)
            line = (f"  rank {rank:<3} {nbytes / MIB:9.2f} MiB ({len(jax.tree.leaves(adapters))} "
                    f"leaves)  full/LoRA bytes {full_bytes / nbytes:8.1f}x")  # fmt: skip
            # The adapters exist at either shape; the generator's base copy only at 0.5B (the
            # merge onto it is bookkeeping, no array is touched), so at 8B it is left out.
            params = _zeros(adapters)
            base = _generation_zeros(lcfg, frozen) if measure else None
            copy_s = _time_copy(lcfg, params, base, args.repeats)
            pull_s = _time_pull(lcfg, params, args.repeats)
            del params, base
            line += f"\n           copy {copy_s * 1e3:9.1f} ms   pull {pull_s * 1e3:9.1f} ms"
            if measure:
                full_copy, full_pull = times["full"]
                line += (f"   full/LoRA time: copy {full_copy / copy_s:6.1f}x  "
                         f"pull {full_pull / pull_s:6.1f}x")  # fmt: skip
            print(line, flush=True)


# --------------------------------------------------------------------------- train step


def _batch(cfg: ModelConfig, rows: int, prompt_len: int, new_tokens: int) -> Batch:
    rng = np.random.default_rng(0)
    prompts = np.repeat(rng.integers(1, cfg.vocab_size, (1, prompt_len)), rows, axis=0)
    tokens = rng.integers(1, cfg.vocab_size, (rows, new_tokens))
    mask = np.ones((rows, new_tokens), bool)
    behavior = -rng.uniform(0.5, 12.0, (rows, new_tokens))  # about a random policy's log-probs
    adv = rng.normal(size=rows)
    return Batch(
        prompt_tokens=jnp.asarray(prompts, jnp.int32),
        prompt_mask=jnp.ones((rows, prompt_len), bool),
        tokens=jnp.asarray(tokens, jnp.int32),
        mask=jnp.asarray(mask),
        loss_mask=jnp.asarray(mask, jnp.float32),
        behavior_logp=jnp.asarray(behavior, jnp.float32),
        adv=jnp.asarray(adv, jnp.float32),
    )


def _time_step(exp, cfg: ModelConfig, batch: Batch, steps: int) -> tuple[float, float, int]:
    """(compile + first step s, s per step after, optimizer-state bytes) on one device."""
    graphdef, frozen, params = split_policy(Policy(cfg, rngs=nnx.Rngs(params=0)), cfg)
    tx = make_optimizer(exp.optim, total_steps=exp.train.steps)
    state = init_train_state(params, tx)
    opt_bytes = state_bytes(state.opt_state)
    step = compile_train_step(graphdef, tx, group_size=batch.adv.shape[0], loss_cfg=exp.loss,
                              temperature=exp.sampler.temperature)  # fmt: skip
    extra = () if frozen is None else (frozen,)
    start = time.perf_counter()
    state, metrics = jax.block_until_ready(step(state, batch, *extra))
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch, *extra)
    jax.block_until_ready((state, metrics))
    return first, (time.perf_counter() - start) / steps, opt_bytes


def train_step(args) -> None:
    exp = load_config(SHAPES["Qwen2.5-0.5B"])
    batch = _batch(exp.model, rows=4, prompt_len=16, new_tokens=48)
    print(f"\ntrain step, Qwen2.5-0.5B shape, 4 rows x 64 tokens, {exp.loss.kind}, "
          f"{jax.devices()[0].device_kind}")  # fmt: skip
    results = {}
    for name, rank in (("full", 0), (f"LoRA rank {args.step_rank}", args.step_rank)):
        results[name] = _time_step(exp, _with_rank(exp.model, rank), batch, args.steps)
        first, per_step, opt_bytes = results[name]
        print(f"  {name:<12} compile + 1st step {first:6.1f} s   {per_step:6.2f} s/step   "
              f"optimizer state {opt_bytes / MIB:9.1f} MiB", flush=True)  # fmt: skip
    (_, full_s, full_opt), (_, lora_s, lora_opt) = results.values()
    print(f"  full/LoRA: step time {full_s / lora_s:.2f}x  "
          f"optimizer state {full_opt / lora_opt:,.0f}x")  # fmt: skip
    for name, path in SHAPES.items():  # optimizer state at both shapes, from shapes alone
        exp = load_config(path)
        tx = make_optimizer(exp.optim, total_steps=exp.train.steps)
        sizes = [state_bytes(jax.eval_shape(tx.init, _abstract_split(_with_rank(exp.model, r))[1]))
                 for r in (0, *args.ranks)]  # fmt: skip
        ratios = "  ".join(
            f"rank {r}: {sizes[0] / s:,.0f}x" for r, s in zip(args.ranks, sizes[1:], strict=True)
        )
        print(f"  {name} optimizer state: full {sizes[0] / 2**30:.2f} GiB, full/LoRA {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("update", "step", "all"), default="all")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    # Read when the CPU backend starts (first use below): a trainer and a generator device.
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    if args.part in ("update", "all"):
        update(args)
    if args.part in ("step", "all"):
        train_step(args)


if __name__ == "__main__":
    main()
