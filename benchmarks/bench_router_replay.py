"""Sampler/trainer mismatch of a tiny bfloat16 Qwen3-MoE policy, with and without router replay.

    python benchmarks/bench_router_replay.py [--experts 64] [--top-k 8] [--rows 32]

The sampler decodes token by token against its KV cache; the trainer scores the same tokens
in one forward over prompt and completion (`completion_logprobs`, what the train step runs).
In bfloat16 the two programs round differently, and where a token's router is near a tie the
trainer's router picks other experts than the sampler's. Prints, over the sampled tokens:
the fraction of routing decisions (token x routed layer) the trainer would make differently,
and the mean and max |log pi_trainer - log pi_sampler| without replay (the trainer routes
afresh) and with it (the trainer reuses the sampler's experts), and their ratios.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_scale.config import ModelConfig
from jaxrl_scale.generation.sampler import generate
from jaxrl_scale.models.moe import rerouted
from jaxrl_scale.models.policy import completion_logprobs, init_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    cfg = ModelConfig(
        architecture="qwen3_moe", qk_norm=True, vocab_size=512, hidden_size=128,
        intermediate_size=256, num_layers=args.layers, num_heads=4, num_kv_heads=2,
        num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=64,
        dtype="bfloat16", router_replay=True,
    )  # fmt: skip
    model = init_policy(cfg, seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 512, rng.integers(4, 17)).tolist() for _ in range(args.rows)]
    ro = generate(model, prompts, max_new_tokens=args.new_tokens, key=jax.random.key(1))
    length = ro.prompt_tokens.shape[1]
    mask_bn = jnp.arange(args.new_tokens)[None, :] < ro.lengths[:, None]
    sampled = np.asarray(ro.completion_mask) > 0
    args_ = (model, ro.prompt_tokens, ro.prompt_mask, ro.completion_tokens, mask_bn)
    behavior = np.asarray(ro.behavior_logp)
    print(
        f"Qwen3-MoE, {args.layers} routed layers, {args.experts} experts, top-{args.top_k}, "
        f"bfloat16 (router float32); {args.rows} rows, {int(sampled.sum())} sampled tokens; "
        f"{jax.default_backend()}, jax {jax.__version__}"
    )
    gaps = {}
    for replay in (False, True):
        logp, chosen = completion_logprobs(
            *args_, routes=ro.routes if replay else None, return_routes=True
        )
        gap = np.abs(np.asarray(logp) - behavior)[sampled]
        gaps[replay] = gap
        differs = np.asarray(rerouted(chosen, ro.routes[:, length:]))[sampled]
        name = "replay" if replay else "no replay"
        print(f"{name:9s}  routes the trainer's router would change: {differs.mean():.4f} of "
              f"decisions, {differs.any(-1).mean():.4f} of tokens; |log ratio| mean "
              f"{gap.mean():.2e}, max {gap.max():.2e}")  # fmt: skip
    print(
        f"no replay / replay: mean |log ratio| {gaps[False].mean() / gaps[True].mean():.2f}x, "
        f"max {gaps[False].max() / gaps[True].max():.2f}x"
    )


if __name__ == "__main__":
    main()
