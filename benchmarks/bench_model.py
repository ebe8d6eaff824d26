"""Policy model throughput, analytic FLOPs and log-prob memory.

    python benchmarks/bench_model.py              # tiny config on whatever JAX sees (CPU here)
    python benchmarks/bench_model.py --qwen05b    # Qwen2.5-0.5B shape, bf16, seq 2048 (GPU)

Prints forward and forward+backward tokens/s, the analytic FLOPs per token that compute
accounting uses (2N + attention to generate, 6N + attention to train), achieved FLOP/s, MFU when
the device's peak is known, and the ratio of chunked to unchunked log-prob temp memory from XLA's
compiled memory analysis.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_scale.config import ModelConfig
from jaxrl_scale.models.policy import Policy, head_logits, logprobs_from_hidden, token_logprobs
from jaxrl_scale.rl.compute import forward_flops, matmul_params, train_flops

TINY = ModelConfig(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    qkv_bias=True,
)
QWEN25_05B = ModelConfig(
    architecture="qwen2",
    vocab_size=151_936,
    hidden_size=896,
    intermediate_size=4864,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    rope_theta=1_000_000.0,
    tie_embeddings=True,
    qkv_bias=True,
    dtype="bfloat16",
    lm_head_dtype="float32",
    logits_chunk_size=512,
)
# Dense bf16 peak FLOP/s by device kind (vendor datasheets).
PEAK_BF16 = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12, "TPU v5 lite": 197e12}


def _time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def bench_throughput(cfg: ModelConfig, batch: int, seq: int, repeats: int) -> None:
    model = Policy(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(0), (batch, seq), 0, cfg.vocab_size)

    def logp_sum(state, tokens):
        return token_logprobs(nnx.merge(graphdef, state), tokens).sum()

    forward = jax.jit(logp_sum)
    backward = jax.jit(jax.grad(logp_sum))
    t_fwd = _time(forward, state, tokens, repeats=repeats)
    t_bwd = _time(backward, state, tokens, repeats=repeats)
    n_tok = batch * seq
    fwd_per_tok = forward_flops(cfg, seq) / seq
    train_per_tok = train_flops(cfg, seq) / seq
    device = jax.devices()[0]
    peak = PEAK_BF16.get(device.device_kind)
    print(f"device: {device.device_kind} x{jax.device_count()}  ({jax.default_backend()})")
    print(
        f"config: N = {matmul_params(cfg):,} matmul params, batch {batch} x seq {seq}, {cfg.dtype}"
    )
    print(f"analytic FLOPs/token: generate {fwd_per_tok:,.0f}  train {train_per_tok:,.0f}")
    for name, seconds, per_tok in (
        ("forward", t_fwd, fwd_per_tok),
        ("forward+backward", t_bwd, train_per_tok),
    ):
        flops = per_tok * n_tok / seconds
        mfu = f"  MFU {flops / peak:.1%}" if peak else ""
        print(f"{name:>17}: {n_tok / seconds:12,.0f} tokens/s  {flops / 1e9:10,.2f} GFLOP/s{mfu}")
    print(f"ratio forward+backward / forward time: {t_bwd / t_fwd:.2f} (ideal ~3)")


def bench_logprob_memory(vocab: int, d: int, seq: int, chunk: int) -> None:
    args = (
        jax.ShapeDtypeStruct((1, seq, d), jnp.float32),
        jax.ShapeDtypeStruct((1, seq), jnp.int32),
        jax.ShapeDtypeStruct((d, vocab), jnp.float32),
    )

    def chunked(h, t, k):
        return logprobs_from_hidden(
            h, t, k, head_dtype="float32", temperature=1.0, chunk_size=chunk
        ).sum()

    def unchunked(h, t, k):
        logp = jax.nn.log_softmax(head_logits(h, k, "float32")[:, :-1], -1)
        return jnp.take_along_axis(logp, t[:, 1:, None], -1).sum()

    temps = {}
    for name, fn in (("chunked", chunked), ("unchunked", unchunked)):
        compiled = jax.jit(jax.grad(fn, argnums=(0, 2))).lower(*args).compile()
        temps[name] = compiled.memory_analysis().temp_size_in_bytes
    mib = {name: t / 2**20 for name, t in temps.items()}
    print(
        f"log-prob fwd+bwd temp memory, V {vocab:,}, T {seq}: chunked {mib['chunked']:,.0f} MiB"
        f" vs unchunked {mib['unchunked']:,.0f} MiB; ratio {mib['chunked'] / mib['unchunked']:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--qwen05b", action="store_true", help="Qwen2.5-0.5B shape, bf16")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.qwen05b:
        cfg, batch, seq = QWEN25_05B, args.batch or 8, args.seq or 2048
    else:
        cfg, batch, seq = TINY, args.batch or 8, args.seq or 256
    bench_throughput(cfg, batch, seq, args.repeats)
    for seq_len in (2048, 8192):
        bench_logprob_memory(151_936, 64, seq_len, 256)


if __name__ == "__main__":
    main()
