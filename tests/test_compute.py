import jax
import numpy as np
from flax import nnx

from jaxrl_scale.compute import forward_flops, generate_flops, matmul_params, train_flops
from jaxrl_scale.config import ModelConfig
from jaxrl_scale.model import init_policy


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


def test_flops_by_hand():
    cfg = ModelConfig()  # N = 77,824; attention 4 * L * H * E = 4 * 2 * 4 * 16 = 512
    # T = 10: 2 * N * 10 + 512 * 10 * 11 / 2 = 1,556,480 + 28,160 = 1,584,640
    assert forward_flops(cfg, 10) == 1_584_640
    assert train_flops(cfg, 10) == 3 * 1_584_640
    assert generate_flops(cfg, 10) == 1_584_640


def test_forward_flops_match_xla_cost_analysis_within_ten_percent():
    """XLA's own count of the compiled forward pass agrees with the analytic one."""
    cfg = ModelConfig(hidden_size=128, intermediate_size=256, vocab_size=256)
    model = init_policy(cfg)
    graphdef, state = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((1, 64), np.int32)
    fn = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    cost = fn.lower(state, tokens).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    analytic = forward_flops(cfg, 64)
    # XLA counts full (unmasked) attention and elementwise ops, so it sits a little above.
    assert 0.9 * analytic < cost["flops"] < 1.25 * analytic, (cost["flops"], analytic)
