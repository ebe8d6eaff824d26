import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_scale.config import ModelConfig
from jaxrl_scale.models.policy import init_policy
from jaxrl_scale.rl.compute import (
    RunClock,
    batch_flops,
    batch_forward_flops,
    forward_flops,
    matmul_params,
    train_flops,
)


def test_matmul_params_by_hand():
    # D 64, F 128, 4 heads x 16, 2 kv heads, V 64, 2 layers:
    # q, o: 64 * 64 each; k, v: 64 * 32 each; mlp: 3 * 64 * 128; head: 64 * 64.
    # per layer 8,192 + 4,096 + 24,576 = 36,864; total 2 * 36,864 + 4,096 = 77,824.
    cfg = ModelConfig()
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128
    assert matmul_params(cfg) == 2 * per_layer + 64 * 64 == 77_824


def test_matmul_params_equals_model_weights_without_embedding_and_norms():
    cfg = ModelConfig(tie_embeddings=False, num_layers=3, head_dim=24)
    model = init_policy(cfg)
    kernels = [
        np.size(v)
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if "kernel" in path[-1] or path[-1] == "lm_head"
    ]
    assert matmul_params(cfg) == sum(kernels)


def test_moe_layers_count_their_active_parameters_by_hand():
    # Layer 0 dense (mlp_only_layers), layer 1 routed: router 64 x 8, and 2 of 8 experts of
    # 3 * 64 * 32 each (the 6 others are not a token's FLOPs). Attention as above: 12,288.
    cfg = ModelConfig(
        architecture="qwen3_moe", num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, mlp_only_layers=(0,),
    )  # fmt: skip
    attn = 2 * 64 * 64 + 2 * 64 * 32
    dense = attn + 3 * 64 * 128
    routed = attn + 64 * 8 + 2 * 3 * 64 * 32
    assert matmul_params(cfg) == dense + routed + 64 * 64 == 36_864 + 25_088 + 4_096
    # The model holds all 8 experts: 6 x 3 x 64 x 32 more weights than a token uses.
    model = init_policy(cfg)
    kernels = sum(
        np.size(v)
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if "kernel" in path[-1]
    )
    assert kernels + 64 * 64 == matmul_params(cfg) + 6 * 3 * 64 * 32


def test_flops_by_hand():
    cfg = ModelConfig()  # N = 77,824; attention 4 * L * H * E = 4 * 2 * 4 * 16 = 512
    # T = 10: 2 * N * 10 + 512 * 10 * 11 / 2 = 1,556,480 + 28,160 = 1,584,640
    assert forward_flops(cfg, 10) == 1_584_640
    assert train_flops(cfg, 10) == 3 * 1_584_640


def test_rl_batch_flops_by_hand():
    """One prompt of 3 real tokens, two completions of 2 and 4 emitted tokens.
    Layers N = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) = 73,728; head 64 * 64 = 4,096;
    a = 4 * 2 layers * 4 heads * 16 = 512 per (query, key).
      prompt, once:   2 * 73,728 * 3 = 442,368; attention 512 * (1 + 2 + 3) = 3,072
      completions:    6 tokens: layers 2 * 73,728 * 6 = 884,736, head 2 * 4,096 * 6 = 49,152
                      attention: positions 3, 4 see 4 + 5 keys; positions 3..6 see 4 + 5 + 6 + 7:
                      512 * (9 + 22) = 15,872
      forward F = 1,395,200 (running each row on its own would count 1,889,792)."""
    cfg = ModelConfig()
    assert batch_forward_flops(cfg, [3], [2, 4]) == 1_395_200
    assert batch_flops(cfg, [3], [2, 4]) == {"gen_flops": 1_395_200, "train_flops": 4_185_600}
    with_reference = batch_flops(cfg, [3], [2, 4], reference=True)
    assert with_reference["train_flops"] == 4 * 1_395_200  # + the KL reference's forward
    # Two prompts: each group attends to its own prompt only.
    two = batch_forward_flops(cfg, [3, 1], [2, 4, 1, 1])
    assert two == 1_395_200 + batch_forward_flops(cfg, [1], [1, 1])
    with pytest.raises(ValueError, match="groups"):
        batch_forward_flops(cfg, [3, 1], [2, 4, 1])


def _slow_to_compile(x):
    # Each sum ends a fusion: 40 small kernels, 0.4-0.8 s to compile. (A chain of reversals,
    # jnp.cos(x[::-1]), grows exponentially under XLA's classic emitters, which the suite uses.)
    for i in range(40):
        x = jnp.sin(x) * (i + 1.0) + jnp.cos(x.sum())
    return x


def test_run_clock_counts_every_device_and_leaves_out_evaluation_and_compiles():
    clock = RunClock(devices=4, seconds=10.0)
    assert clock.device_seconds() == 10.0  # not started: only earlier sessions
    clock.start()
    try:
        begin = time.perf_counter()
        time.sleep(0.1)  # work
        with clock.excluded():
            time.sleep(0.2)  # an evaluation
        compile_begin = time.perf_counter()
        jax.jit(_slow_to_compile).lower(jnp.ones(7)).compile()
        compiling = time.perf_counter() - compile_begin
        wall = time.perf_counter() - begin
        counted = clock.device_seconds() - 10.0
    finally:
        clock.stop()
    assert compiling > 0.1
    assert counted >= 4 * 0.1
    assert counted < 4 * (wall - 0.2 - 0.8 * compiling), (counted, wall, compiling)
