"""Sampler/trainer log-prob mismatch along the precision ladder, at the real vocabulary size.

    python benchmarks/bench_mismatch.py                   # Qwen2.5-0.5B shape (V = 151,936)
    python benchmarks/bench_mismatch.py --layers 4        # a shallower stand-in, quicker on CPU

The sampler decodes token by token from a KV cache; the trainer recomputes the same tokens in
one pass (`completion_logprobs`). Different matmul shapes round differently, so the two
log-probs of one token differ, and that difference is the importance ratio CISPO corrects for
even fully on-policy. For each rung (compute dtype, head dtype, matmul precision) this prints,
over the sampled tokens: mean and max |log pi_sampler - log pi_trainer|, the ESS fraction of the
ratios, the range of per-sequence geometric-mean ratios (the run's metrics of the same names),
and the trainer pass's time relative to the first rung (a ratio measured in this run).

Weights are random (seeded) and rounded to bf16, as a bf16 Hugging Face checkpoint would be, so
every rung runs the same network; only the arithmetic differs. On a CPU every float32 matmul is
exact, so the default and highest float32 rungs coincide there; on GPUs the default is TF32 and
on TPUs one bf16 pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_model import QWEN25_05B
from flax import nnx

from jaxrl_scale.config import ModelConfig
from jaxrl_scale.generation.sampler import generate
from jaxrl_scale.models.policy import Policy, completion_logprobs
from jaxrl_scale.rl.losses import policy_loss

# (label, compute dtype, head dtype, matmul precision)
LADDER = (
    ("bf16 compute + bf16 head", "bfloat16", "bfloat16", "default"),
    ("bf16 compute + FP32 head", "bfloat16", "float32", "default"),
    ("fp32 compute, default precision", "float32", "float32", "default"),
    ("fp32 compute, highest precision", "float32", "float32", "highest"),
)


def bf16_rounded(params):
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)


def measure(cfg: ModelConfig, params, prompts, *, group: int, new_tokens: int, seed: int):
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Policy(cfg, rngs=nnx.Rngs(0))))
    model = nnx.merge(graphdef, params)
    rows = [p for p in prompts for _ in range(group)]
    ro = generate(model, rows, max_new_tokens=new_tokens, temperature=1.0, key=jax.random.key(seed))

    @jax.jit
    def trainer_logp(params, prompt_tokens, prompt_mask, tokens, mask):
        return completion_logprobs(
            nnx.merge(graphdef, params), prompt_tokens, prompt_mask, tokens, mask
        )

    mask = jnp.arange(new_tokens)[None, :] < ro.lengths[:, None]
    args = (params, ro.prompt_tokens[::group], ro.prompt_mask[::group], ro.completion_tokens, mask)
    jax.block_until_ready(trainer_logp(*args))  # compile
    start = time.perf_counter()
    logp = jax.block_until_ready(trainer_logp(*args))
    seconds = time.perf_counter() - start
    zeros = jnp.zeros(len(rows))
    _, m = policy_loss(logp, ro.behavior_logp, zeros, ro.completion_mask, group_size=group)
    keys = ("mismatch", "mismatch_max", "ess_fraction", "seq_ratio_min", "seq_ratio_max")
    return {k: float(m[k]) for k in keys} | {"seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=QWEN25_05B.num_layers)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    base = dataclasses.replace(QWEN25_05B, num_layers=args.layers)
    params = bf16_rounded(nnx.state(Policy(base, rngs=nnx.Rngs(params=args.seed)), nnx.Param))
    rng = np.random.default_rng(args.seed)
    prompts = [
        rng.integers(0, base.vocab_size, args.prompt_len).tolist() for _ in range(args.prompts)
    ]
    print(
        f"# {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}; "
        f"Qwen2.5-0.5B shape, {args.layers} layers, V = {base.vocab_size:,}; "
        f"{args.prompts} prompts x {args.group} samples, {args.prompt_len} prompt + "
        f"{args.new_tokens} new tokens, temperature 1"
    )
    print(
        f"{'rung':<34}{'mean |dlogp|':>13}{'max |dlogp|':>12}{'ESS frac':>10}"
        f"{'seq ratio range':>20}{'x time':>8}"
    )
    first = None
    for label, dtype, head, precision in LADDER:
        cfg = dataclasses.replace(base, dtype=dtype, lm_head_dtype=head, matmul_precision=precision)
        r = measure(
            cfg, params, prompts, group=args.group, new_tokens=args.new_tokens, seed=args.seed
        )
        first = first or r["seconds"]
        span = f"[{r['seq_ratio_min']:.4f}, {r['seq_ratio_max']:.4f}]"
        print(
            f"{label:<34}{r['mismatch']:>13.2e}{r['mismatch_max']:>12.2e}"
            f"{r['ess_fraction']:>10.5f}{span:>20}{r['seconds'] / first:>8.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
