"""Analytic FLOPs of the policy: the x-axis of scaling curves.

N counts the weights of every matmul a token passes through (attention and MLP projections of all
layers plus the vocabulary head; the embedding lookup is free). A forward pass over a sequence of
T tokens costs 2 N T for the matmuls plus the attention itself: per layer, per head, each query
at position p scores and mixes p + 1 keys (causal), 2 * 2 * E FLOPs per key, summed over
p = 0..T-1 gives 4 E T (T + 1) / 2. Training (forward + backward) costs 3x the forward pass:
6 N per token plus 3x the attention. Generation costs the forward pass of the finished sequence
(a KV cache computes each position once): 2 N per token plus attention.
"""

from __future__ import annotations

from jaxrl_scale.config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    """N: weights of all matmuls per token (layers + head), excluding the embedding lookup."""
    d, f, e = cfg.hidden_size, cfg.intermediate_size, cfg.resolved_head_dim
    attn = d * cfg.num_heads * e * 2 + d * cfg.num_kv_heads * e * 2  # q, o and k, v
    mlp = 3 * d * f
    return cfg.num_layers * (attn + mlp) + d * cfg.vocab_size


def forward_flops(cfg: ModelConfig, seq_len: int) -> float:
    """FLOPs of one forward pass over `seq_len` tokens (causal attention)."""
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.resolved_head_dim
    return 2.0 * matmul_params(cfg) * seq_len + attention * seq_len * (seq_len + 1) / 2


def train_flops(cfg: ModelConfig, seq_len: int) -> float:
    """FLOPs of forward + backward over `seq_len` tokens: 3x the forward pass."""
    return 3.0 * forward_flops(cfg, seq_len)


def generate_flops(cfg: ModelConfig, seq_len: int) -> float:
    """FLOPs to produce a sequence of `seq_len` tokens (prompt + completion) with a KV cache."""
    return forward_flops(cfg, seq_len)
