import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_FIXTURES
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

from jaxrl_scale.config import ConfigError, MeshConfig
from jaxrl_scale.models.hf import load_pretrained
from jaxrl_scale.models.policy import Policy, init_policy, token_logprobs
from jaxrl_scale.parallel import sharding

MESH_222 = MeshConfig(data=2, fsdp=2, tensor=2)


def test_eight_fake_devices():
    assert len(jax.devices()) == 8


def test_make_mesh_shapes_and_errors():
    want = {"data": 8, "fsdp": 1, "expert": 1, "tensor": 1}
    assert dict(sharding.make_mesh(MeshConfig()).shape) == want
    assert dict(sharding.make_mesh(MeshConfig(data=-1, tensor=2)).shape)["data"] == 4
    with pytest.raises(ConfigError, match="needs 12 devices, have 8"):
        sharding.make_mesh(MeshConfig(data=3, fsdp=2, tensor=2))
    with pytest.raises(ConfigError, match="do not divide"):
        sharding.make_mesh(MeshConfig(data=-1, tensor=3))


def test_sharded_init_places_params_by_logical_axes(tiny_model_config):
    mesh = sharding.make_mesh(MESH_222)
    model = sharding.init_sharded(lambda rngs: Policy(tiny_model_config, rngs=rngs), mesh, 4)
    attn = model.layers[0].attn
    assert attn.q_kernel[...].sharding.spec == P("fsdp", "tensor", None)
    assert model.layers[0].mlp.down_kernel[...].sharding.spec == P("tensor", "fsdp")
    assert model.embedding[...].sharding.spec == P("tensor", "fsdp")
    assert model.final_norm[...].sharding.spec == P(None)
    # q_kernel is [64, 4, 16]: each of the 8 devices holds a [32, 2, 16] block.
    assert attn.q_kernel[...].addressable_shards[0].data.shape == (32, 2, 16)
    # Same values as an unsharded init with the same seed (to an ulp: jit fuses the sampler).
    single = init_policy(tiny_model_config, seed=4)
    for a, b in zip(
        jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(single)), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-8)


def test_axis_that_does_not_divide_stays_replicated(tiny_model_config):
    # 4 query heads split over tensor=4; 2 kv heads do not, so k_kernel keeps its heads whole.
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))
    model = sharding.init_sharded(lambda rngs: Policy(tiny_model_config, rngs=rngs), mesh, 0)
    assert model.layers[0].attn.k_kernel[...].sharding.spec == P("fsdp", None, None)
    assert model.layers[0].attn.q_kernel[...].sharding.spec == P("fsdp", "tensor", None)


def test_an_expert_axis_splits_other_weights_on_fsdp_meshes_only():
    """Trainer (fsdp x expert): an expert shard is one more FSDP shard outside the experts.
    Generator devices (no fsdp): the experts split over all of them, the rest whole."""
    from conftest import TINY_CONFIG

    from jaxrl_scale.config import load_config

    moe = ["model.architecture=qwen3_moe", "model.num_experts=4", "model.num_experts_per_tok=2"]
    moe += ["model.moe_intermediate_size=16", "mesh.data=1", "mesh.fsdp=2", "mesh.expert=2"]
    cfg = load_config(TINY_CONFIG, [*moe, "pipeline.generator_devices=4"])
    mesh, gen_mesh = sharding.make_meshes(cfg)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "expert": 2, "tensor": 1}
    assert dict(gen_mesh.shape) == {"data": 1, "fsdp": 1, "expert": 4, "tensor": 1}
    state = nnx.state(nnx.eval_shape(lambda: Policy(cfg.model, rngs=nnx.Rngs(0))))

    def spec(mesh, layer_path):
        node = state["layers"][0]
        for key in layer_path:
            node = node[key]
        return sharding.variable_sharding(node, mesh).spec

    assert spec(mesh, ["attn", "q_kernel"]) == P(("fsdp", "expert"), "tensor", None)
    assert spec(mesh, ["mlp", "gate_kernel"]) == P("expert", "fsdp", "tensor")
    assert spec(gen_mesh, ["attn", "q_kernel"]) == P("fsdp", "tensor", None)  # all size 1
    assert spec(gen_mesh, ["mlp", "gate_kernel"]) == P("expert", "fsdp", "tensor")
    # Experts that do not divide over the generator's devices stay whole there.
    three = load_config(TINY_CONFIG, [*moe, "pipeline.generator_devices=3"])
    assert dict(sharding.make_meshes(three)[1].shape)["expert"] == 1


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_sharded_forward_and_logprobs_match_single_device(arch):
    mesh = sharding.make_mesh(MESH_222)
    single, _ = load_pretrained(HF_FIXTURES / arch)
    sharded, _ = load_pretrained(HF_FIXTURES / arch, mesh=mesh)
    assert sharded.embedding[...].sharding.spec == P("tensor", "fsdp")
    ref = load_file(str(HF_FIXTURES / arch / "reference.safetensors"))
    tokens = jnp.asarray(np.concatenate([ref["tokens"], ref["padded_tokens"][:1]]))  # B = 4
    mask = jnp.asarray(np.concatenate([np.ones_like(ref["tokens"]), ref["padded_mask"][:1]]))
    placed = jax.device_put(tokens, sharding.batch_sharding(mesh))
    placed_mask = jax.device_put(mask, sharding.batch_sharding(mesh))

    forward = nnx.jit(lambda m, t, k: m(t, mask_bt=k))
    logprobs = nnx.jit(lambda m, t, k: token_logprobs(m, t, mask_bt=k, chunk_size=8))
    np.testing.assert_allclose(
        forward(sharded, placed, placed_mask), single(tokens, mask_bt=mask), atol=1e-5, rtol=0
    )
    np.testing.assert_allclose(
        logprobs(sharded, placed, placed_mask),
        token_logprobs(single, tokens, mask_bt=mask, chunk_size=8),
        atol=1e-5,
        rtol=0,
    )
