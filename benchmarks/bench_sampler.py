"""Decode throughput: KV-cache sampler vs naive full recomputation, and tokens/s vs batch.

    python benchmarks/bench_sampler.py [--new 256]

Same tiny random model for both; greedy decoding of `--new` tokens after a 16-token prompt. The
naive decoder runs a full forward pass over the fixed-width buffer for every new token (one
compiled function, no cache). Prints tokens/s of each and their ratio (expect >= 5x at 256).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_model import TINY  # the same tiny config as the model benchmark
from flax import nnx

from jaxrl_scale.generation.sampler import generate
from jaxrl_scale.models.policy import init_policy


def _prompts(batch: int, length: int = 16):
    rng = np.random.default_rng(0)
    return [list(rng.integers(1, TINY.vocab_size, length)) for _ in range(batch)]


def cached_rate(model, batch: int, new: int) -> float:
    prompts = _prompts(batch)
    generate(model, prompts, max_new_tokens=new, temperature=0.0)  # compile
    start = time.perf_counter()
    ro = generate(model, prompts, max_new_tokens=new, temperature=0.0)
    jax.block_until_ready(ro.completion_tokens)
    return batch * new / (time.perf_counter() - start)


def naive_rate(model, batch: int, new: int) -> float:
    prompts = np.asarray(_prompts(batch), np.int32)
    width = prompts.shape[1] + new

    @nnx.jit
    def step(model, buf, i):
        logits = model(buf)
        nxt = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, i - 1, axis=1, keepdims=False), -1)
        return jax.lax.dynamic_update_index_in_dim(buf, nxt.astype(buf.dtype), i, axis=1)

    def run():
        buf = jnp.zeros((batch, width), jnp.int32).at[:, : prompts.shape[1]].set(prompts)
        for i in range(prompts.shape[1], width):
            buf = step(model, buf, i)
        return jax.block_until_ready(buf)

    step(model, jnp.zeros((batch, width), jnp.int32), prompts.shape[1])  # compile
    start = time.perf_counter()
    run()
    return batch * new / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    model = init_policy(TINY)
    print(f"device: {jax.devices()[0].device_kind}; tiny model, greedy, {args.new} new tokens")
    cached = cached_rate(model, args.batch, args.new)
    naive = naive_rate(model, args.batch, args.new)
    print(
        f"batch {args.batch}: KV cache {cached:,.0f} tokens/s, full recomputation "
        f"{naive:,.0f} tokens/s, ratio {cached / naive:.1f}x"
    )
    for batch in (1, 4, 16, 64):
        print(
            f"  batch {batch:>3}: {cached_rate(model, batch, args.new):>10,.0f} tokens/s (KV cache)"
        )


if __name__ == "__main__":
    main()
