"""Mixture-of-experts matmuls: the grouped ("ragged") experts against the all-experts einsum
("dense") in a training forward + backward of a small Qwen3-MoE-shaped policy.

    python benchmarks/bench_moe.py [--experts 16] [--top-k 2] [--tokens 2048]

Prints, per `model.moe_matmul`, the step time (median of 5 after compilation), the compiled
program's FLOPs (XLA's cost analysis) and temporary memory, and the ratios dense / ragged.
On CPU XLA lowers jax.lax.ragged_dot to a dense matmul over masked copies of the tokens (one
per expert), so the ragged program's FLOPs are not K / E of the dense one's there; on GPUs
and TPUs ragged_dot is a grouped matmul.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_scale.config import ModelConfig
from jaxrl_scale.models.policy import Policy, token_logprobs


def _step(cfg: ModelConfig, tokens):
    graphdef, params = nnx.split(Policy(cfg, rngs=nnx.Rngs(params=0)))

    def loss(p):
        return -jnp.sum(token_logprobs(nnx.merge(graphdef, p), tokens))

    step = jax.jit(jax.grad(loss))
    compiled = step.lower(params).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    memory = compiled.memory_analysis()
    jax.block_until_ready(step(params))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(step(params))
        times.append(time.perf_counter() - start)
    return statistics.median(times), float(cost.get("flops", 0.0)), memory.temp_size_in_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="rows x sequence length")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    cfg = ModelConfig(
        architecture="qwen3_moe", qk_norm=True, vocab_size=1024, hidden_size=256,
        intermediate_size=512, num_layers=args.layers, num_heads=4, num_kv_heads=2,
        num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=256,
    )  # fmt: skip
    rows = max(1, args.tokens // 256)
    tokens = jax.random.randint(jax.random.key(0), (rows, args.tokens // rows), 0, 1024)
    print(
        f"Qwen3-MoE shape: {args.layers} layers, D 256, {args.experts} experts of width 256, "
        f"top-{args.top_k}, {tokens.size} tokens; {jax.default_backend()}, jax {jax.__version__}"
    )
    results = {}
    for matmul in ("dense", "ragged", "tiled"):
        results[matmul] = _step(dataclasses.replace(cfg, moe_matmul=matmul), tokens)
        t, flops, temp = results[matmul]
        print(f"{matmul:7s} step {t * 1e3:9.1f} ms   {flops / 1e9:8.2f} GFLOP   "
              f"temporaries {temp / 2**20:8.1f} MiB")  # fmt: skip
    td, fd, md = results["dense"]
    for other in ("ragged", "tiled"):
        t, f, m = results[other]
        print(f"dense / {other}: time {td / t:.2f}x, FLOPs {fd / max(f, 1):.2f}x, "
              f"temporaries {md / max(m, 1):.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
