"""Mixture-of-experts layers (moe.py): routing against a numpy reference, the grouped (ragged)
expert matmuls against the all-experts reference and a per-token loop, Hugging Face parity of
both, config checks, and an RL run of an MoE policy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_FIXTURES
from safetensors.numpy import load_file

from jaxrl_scale.config import ConfigError, ModelConfig
from jaxrl_scale.hf import load_pretrained
from jaxrl_scale.moe import experts_dense, experts_ragged, experts_tiled, route

N, D, E, K, F = 13, 8, 6, 2, 5


def _np_route(logits, k, normalize):
    """softmax, the k largest (ties to the lower index), optionally renormalised."""
    z = np.exp(logits - logits.max(-1, keepdims=True))
    probs = z / z.sum(-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, experts, -1)
    if normalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, experts, probs


def _silu(x):
    return x / (1 + np.exp(-x))


def _np_experts(x, weights, experts, gate, up, down):
    """Token by token, expert by expert: what the layer means."""
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for w, e in zip(weights[n], experts[n], strict=True):
            out[n] += w * ((_silu(x[n] @ gate[e]) * (x[n] @ up[e])) @ down[e])
    return out


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, D)).astype(np.float32)
    kernels = [rng.normal(size=s).astype(np.float32) * 0.5 for s in ((E, D, F),) * 2 + ((E, F, D),)]
    logits = rng.normal(size=(N, E)).astype(np.float32)
    return x, kernels, logits


@pytest.mark.parametrize("normalize", [True, False])
def test_routing_matches_a_numpy_reference(normalize):
    _, _, logits = _inputs()
    logits[0, 1] = logits[0, 4] = logits[0].max() + 1.0  # a tie: the lower expert first
    weights, experts = route(jnp.asarray(logits), K, normalize=normalize)
    want_w, want_e, probs = _np_route(logits.astype(np.float64), K, normalize)
    np.testing.assert_array_equal(np.asarray(experts), want_e)
    assert tuple(want_e[0]) == (1, 4)
    np.testing.assert_allclose(np.asarray(weights), want_w, rtol=1e-5)
    # Replayed experts: their probabilities, renormalised alike, whatever the logits prefer.
    forced = np.tile(np.array([[0, 5]]), (N, 1))
    weights, experts = route(jnp.asarray(logits), K, normalize=normalize, experts_nk=forced)
    picked = probs[:, [0, 5]]
    want = picked / picked.sum(-1, keepdims=True) if normalize else picked
    np.testing.assert_array_equal(np.asarray(experts), forced)
    np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-5)


def test_grouped_and_dense_experts_equal_a_per_token_loop_with_their_gradients():
    x, kernels, logits = _inputs(1)
    weights, experts = route(jnp.asarray(logits), K, normalize=True)
    want = _np_experts(x, np.asarray(weights), np.asarray(experts), *kernels)
    args = (jnp.asarray(x), weights, experts, *map(jnp.asarray, kernels))
    for fn in (experts_dense, experts_ragged, experts_tiled):
        np.testing.assert_allclose(np.asarray(fn(*args)), want, rtol=1e-4, atol=1e-5)
    # Tiles of 4 rows: experts' groups span several tiles, and some tiles are padding.
    tiny = experts_tiled(*args, tile=4)
    np.testing.assert_allclose(np.asarray(tiny), want, rtol=1e-4, atol=1e-5)
    # Gradients (inputs, routing weights, every expert's matrices) agree too.
    probe = jnp.asarray(np.random.default_rng(2).normal(size=(N, D)), jnp.float32)

    def loss(fn):
        return lambda x, w, *k: jnp.sum(fn(x, w, experts, *k) * probe)

    diff = (0, 1, 2, 3, 4)
    flat = (args[0], args[1], *args[3:])
    dense = jax.grad(loss(experts_dense), argnums=diff)(*flat)
    for fn in (experts_ragged, experts_tiled):
        grouped = jax.grad(loss(fn), argnums=diff)(*flat)
        for a, b in zip(dense, grouped, strict=True):
            assert float(jnp.abs(a).max()) > 0
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("matmul", ["dense", "ragged", "tiled"])
def test_qwen3_moe_logits_match_transformers_reference(matmul):
    model, _ = load_pretrained(HF_FIXTURES / "qwen3_moe", moe_matmul=matmul)
    cfg = model.cfg
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 48)
    assert [cfg.routed(i) for i in range(cfg.num_layers)] == [False, True]  # mlp_only_layers
    ref = load_file(str(HF_FIXTURES / "qwen3_moe" / "reference.safetensors"))
    logits = np.asarray(model(jnp.asarray(ref["tokens"])))
    assert np.abs(logits - ref["logits"]).max() < 1e-4
    mask = ref["padded_mask"].astype(bool)
    padded = np.asarray(model(jnp.asarray(ref["padded_tokens"]), mask_bt=jnp.asarray(mask)))
    assert np.abs(padded - ref["padded_logits"])[mask].max() < 1e-4


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(architecture="qwen3", num_experts=4), "model.num_experts: experts need"),
        (dict(num_experts=0), "model.num_experts: qwen3_moe needs >= 1 expert"),
        (dict(num_experts_per_tok=5), r"model.num_experts_per_tok: must be in \[1, 4\]"),
        (dict(moe_intermediate_size=0), "model.moe_intermediate_size: must be > 0"),
        (dict(mlp_only_layers=(2,)), r"model.mlp_only_layers: \[2\] are not layers of 2"),
        (dict(mlp_only_layers=(0,), scan_layers=True), "model.scan_layers: needs every layer"),
    ],
)
def test_moe_settings_are_checked_and_named(fields, message):
    base = dict(
        architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8
    )
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**base, **fields})


def test_an_moe_policy_trains_with_rl(tmp_path):
    from conftest import FAST, TINY_CONFIG

    from jaxrl_scale.config import load_config
    from jaxrl_scale.train import train

    moe = ["model.architecture=qwen3_moe", "model.qk_norm=true", "model.num_experts=4"]
    moe += ["model.num_experts_per_tok=2", "model.moe_intermediate_size=16"]
    moe += ["model.mlp_only_layers=[0]", "model.num_layers=2", "train.steps=2"]
    rows = train(load_config(TINY_CONFIG, [*FAST, *moe]), tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]  # the slot engine decoded, the step trained
    assert all(np.isfinite(r["loss"]) and r["gen_tokens"] > 0 for r in rows[1:])


def test_policy_gradients_reach_the_router_and_agree_between_matmuls():
    from flax import nnx

    from jaxrl_scale.model import init_policy, token_logprobs

    cfg = ModelConfig(
        architecture="qwen3_moe", qk_norm=True, vocab_size=32, hidden_size=16,
        intermediate_size=32, num_heads=2, num_kv_heads=1, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=8,
    )  # fmt: skip
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 32)
    grads = {}
    for matmul in ("dense", "ragged", "tiled"):
        model = init_policy(dataclasses.replace(cfg, moe_matmul=matmul), seed=3)
        grads[matmul] = nnx.grad(lambda m: jnp.sum(token_logprobs(m, tokens)))(model)
    router = grads["dense"]["layers"][1]["mlp"]["router_kernel"].get_value()
    assert float(jnp.abs(router).max()) > 1e-6
    for other in ("ragged", "tiled"):
        pairs = zip(jax.tree.leaves(grads["dense"]), jax.tree.leaves(grads[other]), strict=True)
        for a, b in pairs:
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("matmul", ["tiled", "ragged"])
def test_a_data_parallel_moe_forward_keeps_each_shard_on_its_rows(matmul):
    """Traced under a mesh (as the train step is), each batch shard routes and multiplies its
    own rows: the compiled program moves no activations between devices (a sort over the
    whole batch would gather every row everywhere) and equals one device's forward."""
    from flax import nnx

    from jaxrl_scale import sharding
    from jaxrl_scale.config import MeshConfig
    from jaxrl_scale.model import init_policy

    cfg = ModelConfig(
        architecture="qwen3_moe", qk_norm=True, vocab_size=32, hidden_size=16,
        intermediate_size=32, num_heads=2, num_kv_heads=1, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=8, moe_matmul=matmul,
    )  # fmt: skip
    graphdef, state = nnx.split(init_policy(cfg, seed=1))
    tokens = jax.random.randint(jax.random.key(0), (8, 6), 0, 32)
    mesh = sharding.make_mesh(MeshConfig(data=4), jax.devices()[:4])

    def forward(state, tokens):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return nnx.merge(graphdef, state)(tokens)

    rows = sharding.batch_sharding(mesh)
    run = jax.jit(forward, in_shardings=(sharding.replicated(mesh), rows), out_shardings=rows)
    placed = (jax.device_put(state, sharding.replicated(mesh)), jax.device_put(tokens, rows))
    hlo = run.lower(*placed).compile().as_text()
    for collective in ("all-gather", "all-to-all", "all-reduce", "collective-permute"):
        assert collective not in hlo, collective
    want = nnx.merge(graphdef, state)(tokens)
    np.testing.assert_allclose(np.asarray(run(*placed)), np.asarray(want), atol=1e-5)


def test_a_qwen3_moe_config_without_its_expert_fields_is_named(tmp_path):
    import json
    import shutil

    from jaxrl_scale.hf import CheckpointError

    path = shutil.copytree(HF_FIXTURES / "qwen3_moe", tmp_path / "m")
    hf = json.loads((path / "config.json").read_text())
    del hf["num_local_experts"], hf["moe_intermediate_size"]
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match="without num_experts, moe_intermediate_size"):
        load_pretrained(path)


def test_lora_on_an_moe_keeps_the_router_float32_and_says_what_it_adapts():
    from flax import nnx

    from jaxrl_scale.config import LoRAConfig
    from jaxrl_scale.lora import split_policy
    from jaxrl_scale.model import Policy

    lora = LoRAConfig(rank=2, targets=("all",), base_dtype="bfloat16")
    with pytest.warns(UserWarning, match="routed layers' experts stay frozen"):
        cfg = ModelConfig(
            architecture="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=8, mlp_only_layers=(0,), lora=lora,
        )  # fmt: skip
    _, frozen, _ = split_policy(Policy(cfg, rngs=nnx.Rngs(0)), cfg)
    moe = frozen["layers"][1]["mlp"]
    assert moe["router_kernel"].get_value().dtype == jnp.float32
    assert moe["gate_kernel"].get_value().dtype == jnp.bfloat16
