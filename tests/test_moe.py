"""Mixture-of-experts layers (moe.py): routing against a numpy reference, the grouped (ragged)
expert matmuls against the all-experts reference and a per-token loop, Hugging Face parity of
both, config checks, and an RL run of an MoE policy."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_FIXTURES
from safetensors.numpy import load_file

from jaxrl_scale.config import ConfigError, ModelConfig
from jaxrl_scale.models.hf import load_pretrained
from jaxrl_scale.models.moe import experts_dense, experts_ragged, experts_scan, experts_tiled, route

N, D, E, K, F = 13, 8, 6, 2, 5


def _tiny_moe(**fields) -> ModelConfig:
    """A small Qwen3-MoE policy: 4 experts, top-2 (`fields` override)."""
    base = dict(
        architecture="qwen3_moe", qk_norm=True, vocab_size=32, hidden_size=16,
        intermediate_size=32, num_heads=2, num_kv_heads=1, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=8,
    )  # fmt: skip
    return ModelConfig(**{**base, **fields})


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
    # Every forward in one compiled program (op by op, each op would compile on its own);
    # then tiles of 4 rows: experts' groups span several tiles, and some tiles are padding.
    forwards = [experts_dense, experts_ragged, experts_tiled, experts_scan]
    forwards += [functools.partial(fn, tile=4) for fn in (experts_tiled, experts_scan)]
    outs = jax.jit(lambda *a: [fn(*a) for fn in forwards])(*args)
    for out in outs:
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-5)
    # Gradients (inputs, routing weights, every expert's matrices) agree too.
    probe = jnp.asarray(np.random.default_rng(2).normal(size=(N, D)), jnp.float32)

    def loss(fn):
        return lambda x, w, *k: jnp.sum(fn(x, w, experts, *k) * probe)

    diff = (0, 1, 2, 3, 4)
    flat = (args[0], args[1], *args[3:])
    fns = (experts_dense, experts_ragged, experts_tiled, functools.partial(experts_scan, tile=4))
    dense, *others = jax.jit(lambda *a: [jax.grad(loss(fn), argnums=diff)(*a) for fn in fns])(*flat)
    for grouped in others:
        for a, b in zip(dense, grouped, strict=True):
            assert float(jnp.abs(a).max()) > 0
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("matmul", ["dense", "ragged", "tiled", "scan"])
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


@pytest.mark.parametrize("replay", [False, True])
def test_an_moe_policy_trains_with_rl(tmp_path, replay):
    from conftest import FAST, TINY_CONFIG

    from jaxrl_scale.config import load_config
    from jaxrl_scale.train import train

    moe = ["model.architecture=qwen3_moe", "model.qk_norm=true", "model.num_experts=4"]
    moe += ["model.num_experts_per_tok=2", "model.moe_intermediate_size=16"]
    moe += ["model.mlp_only_layers=[0]", "model.num_layers=2", "train.steps=2"]
    # One warm-start step: its step compiles again on a second call (the optimizer state
    # comes back in other shardings than tx.init's), and the RL part is what is checked here.
    moe += ["warm_start.steps=1"]
    if replay:  # the experts ride from the slot engine on expert-parallel generator devices
        # through the packed batch to an fsdp x expert trainer
        moe += ["model.router_replay=true", "train.packing=true", "pipeline.generator_devices=4"]
        moe += ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=2"]
        # Rows of 48 hold any 2 groups (a prompt of <= 8 and 4 x 4 tokens): every batch packs
        # into one bucket of 4 rows, one compiled step (rows of 24 needed 5 -> 8 rows at first).
        moe += ["train.pack_length=48"]
        # Rollouts decode on the slot engine; the static path only evaluates, with fixed
        # weights, for which chunks change nothing but compile decode again (its state comes
        # back from the first chunk in other shardings): one chunk.
        moe += ["sampler.chunk_size=0"]
    rows = train(load_config(TINY_CONFIG, [*FAST, *moe]), tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]  # the slot engine decoded, the step trained
    assert all(np.isfinite(r["loss"]) and r["gen_tokens"] > 0 for r in rows[1:])
    if replay:  # float32 sampler and trainer agree on nearly every route
        assert all(0 <= r["router_differs"] < 0.05 and r["train_packed"] for r in rows[1:])
        assert all(r["mismatch"] < 1e-3 for r in rows[1:])
    else:
        assert "router_differs" not in rows[1]


@pytest.fixture(scope="module")
def one_device_grads():
    """matmul -> (parameters, loss function, tokens, loss, gradients): an 8-expert policy's
    summed token log-probs and their gradients on one device, computed once per matmul for
    the tests below, which compare the matmuls (the same parameters under each) and the
    meshes against them."""
    from flax import nnx

    from jaxrl_scale.models.policy import init_policy, token_logprobs

    tokens = jax.random.randint(jax.random.key(0), (8, 6), 0, 32)
    done = {}

    def get(matmul):
        if matmul not in done:
            graphdef, state = nnx.split(init_policy(_tiny_moe(num_experts=8, moe_matmul=matmul), 1))

            def loss(state, tokens):
                return jnp.sum(token_logprobs(nnx.merge(graphdef, state), tokens))

            want, want_grads = jax.jit(jax.value_and_grad(loss))(state, tokens)
            done[matmul] = (state, loss, tokens, want, want_grads)
        return done[matmul]

    return get


def test_policy_gradients_reach_the_router_and_agree_between_matmuls(one_device_grads):
    grads = {m: one_device_grads(m)[-1] for m in ("dense", "ragged", "tiled")}
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

    from jaxrl_scale.config import MeshConfig
    from jaxrl_scale.models.policy import init_policy
    from jaxrl_scale.parallel import sharding

    cfg = _tiny_moe(moe_matmul=matmul)
    graphdef, state = nnx.split(init_policy(cfg, seed=1))
    tokens = jax.random.randint(jax.random.key(0), (8, 6), 0, 32)
    mesh = sharding.make_mesh(MeshConfig(data=4), jax.devices()[:4])

    def forward(state, tokens):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return nnx.merge(graphdef, state)(tokens)

    rows = sharding.batch_sharding(mesh)
    run = jax.jit(forward, in_shardings=(sharding.replicated(mesh), rows), out_shardings=rows)
    placed = (jax.device_put(state, sharding.replicated(mesh)), jax.device_put(tokens, rows))
    compiled = run.lower(*placed).compile()  # the program inspected is the one that runs
    hlo = compiled.as_text()
    for collective in ("all-gather", "all-to-all", "all-reduce", "collective-permute"):
        assert collective not in hlo, collective
    want = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)  # one device
    np.testing.assert_allclose(np.asarray(compiled(*placed)), np.asarray(want), atol=1e-5)


def test_a_qwen3_moe_config_without_its_expert_fields_is_named(tmp_path):
    import json
    import shutil

    from jaxrl_scale.models.hf import CheckpointError

    path = shutil.copytree(HF_FIXTURES / "qwen3_moe", tmp_path / "m")
    hf = json.loads((path / "config.json").read_text())
    del hf["num_local_experts"], hf["moe_intermediate_size"]
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match="without num_experts, moe_intermediate_size"):
        load_pretrained(path)


def test_lora_on_an_moe_keeps_the_router_float32_and_says_what_it_adapts():
    from flax import nnx

    from jaxrl_scale.config import LoRAConfig
    from jaxrl_scale.models.lora import split_policy
    from jaxrl_scale.models.policy import Policy

    lora = LoRAConfig(rank=2, targets=("all",), base_dtype="bfloat16")
    with pytest.warns(UserWarning, match="routed layers' experts stay frozen"):
        cfg = _tiny_moe(mlp_only_layers=(0,), lora=lora)  # 2 layers: dense, then routed
    _, frozen, _ = split_policy(Policy(cfg, rngs=nnx.Rngs(0)), cfg)
    moe = frozen["layers"][1]["mlp"]
    assert moe["router_kernel"].get_value().dtype == jnp.float32
    assert moe["gate_kernel"].get_value().dtype == jnp.bfloat16


# --------------------------------------------------------------------------- router replay

REPLAY_CFG = _tiny_moe(num_layers=2, num_experts_per_tok=1, router_replay=True)
REPLAY_PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11, 12], [20], [1, 2]]


def _near_tie(model, sign: float, eps: float = 1e-3):
    """Every routed layer's router ties experts 0 and 1 but for +-eps along one direction (the
    others at logit 0): `sign` decides which of the two each token goes to, as a sampler's
    and a trainer's numerics may break a near-tie differently."""
    v = np.asarray(jax.random.normal(jax.random.key(9), (REPLAY_CFG.hidden_size,)))
    kernel = np.zeros((REPLAY_CFG.hidden_size, REPLAY_CFG.num_experts), np.float32)
    kernel[:, 0], kernel[:, 1] = sign * eps * v, -sign * eps * v
    for layer in model.layers:
        layer.mlp.router_kernel.set_value(jnp.asarray(kernel))
        down = layer.mlp.down_kernel  # experts that matter: a flipped route moves log-probs
        down.set_value(down.get_value() * 30)
    return model


@pytest.fixture(scope="module")
def replay_rollout():
    """(sampler, trainer, rollout): the near-tie pair and the sampler's rollout, built once
    for the tests below (which read them and change none of them)."""
    from jaxrl_scale.generation.sampler import generate
    from jaxrl_scale.models.policy import init_policy

    sampler = _near_tie(init_policy(REPLAY_CFG, seed=4), +1.0)
    trainer = _near_tie(init_policy(REPLAY_CFG, seed=4), -1.0)
    ro = generate(sampler, REPLAY_PROMPTS, max_new_tokens=6, key=jax.random.key(2))
    return sampler, trainer, ro


def _real(ro):
    """[B, L + N] bool: the prompt and completion positions that hold tokens."""
    n = ro.completion_tokens.shape[1]
    completion = np.arange(n)[None, :] < np.asarray(ro.lengths)[:, None]
    return np.concatenate([np.asarray(ro.prompt_mask), completion], axis=1)


def test_the_sampler_records_the_experts_its_forward_chose(replay_rollout):
    from flax import nnx

    sampler, _, ro = replay_rollout
    assert ro.routes.dtype == np.uint8
    assert ro.routes.shape == (4, 8 + 6, 2, 1)  # [B, L + N, routed layers, K]
    tokens = jnp.concatenate([ro.prompt_tokens, ro.completion_tokens], axis=1)
    real = _real(ro)
    forward = nnx.jit(lambda m, t, mask: m.hidden_states(t, mask_bt=mask, return_routes=True))
    _, chosen = forward(sampler, tokens, jnp.asarray(real))
    recorded, chosen = np.asarray(ro.routes)[real], np.asarray(chosen)[real]
    np.testing.assert_array_equal(recorded, chosen)
    assert 0 < np.mean(recorded == 0) < 1  # the near-tie sends tokens both ways


def test_router_replay_makes_trainer_logprobs_equal_the_samplers(replay_rollout):
    """The trainer's router breaks the near-tie the other way: without replay every token
    goes to the other expert and its log-prob moves; with the sampler's experts replayed the
    trainer scores exactly what the sampler sampled, padded and packed alike."""
    from flax import nnx

    from jaxrl_scale.models.moe import rerouted
    from jaxrl_scale.models.policy import completion_logprobs
    from jaxrl_scale.rl.packing import pack, packed_logprobs, unpack
    from jaxrl_scale.rl.step import Batch

    _, trainer, ro = replay_rollout
    sampled = np.asarray(ro.completion_mask) > 0
    behavior = np.asarray(ro.behavior_logp)
    args = (trainer, ro.prompt_tokens, ro.prompt_mask, ro.completion_tokens)
    mask_bn = jnp.arange(6)[None, :] < ro.lengths[:, None]
    scores = nnx.jit(completion_logprobs, static_argnames="return_routes")  # as the step does
    fresh = np.asarray(scores(*args, mask_bn))
    assert np.abs(fresh - behavior)[sampled].max() > 1e-2  # routing flipped: a real mismatch

    replayed, chosen = scores(*args, mask_bn, routes=ro.routes, return_routes=True)
    np.testing.assert_allclose(np.asarray(replayed)[sampled], behavior[sampled], atol=2e-5)
    flipped = np.asarray(rerouted(chosen, ro.routes[:, 8:]))  # [B, N, routed layers]
    assert flipped[sampled].mean() > 0.9  # the trainer alone would route them elsewhere

    host = jax.tree.map(np.asarray, ro)
    batch = Batch.from_rollout(host, np.ones(4), np.ones(4, bool), xp=np)
    packed, _ = pack(batch, 1, row_len=32)
    logp_rs = nnx.jit(packed_logprobs)(trainer, jax.tree.map(jnp.asarray, packed))
    np.testing.assert_allclose(unpack(logp_rs, packed, 6)[sampled], behavior[sampled], atol=2e-5)


def test_the_train_step_reports_how_often_replay_overrode_the_trainers_router(replay_rollout):
    import optax
    from flax import nnx

    from jaxrl_scale.config import LossConfig
    from jaxrl_scale.rl.step import Batch, compile_train_step, init_train_state

    _, trainer, ro = replay_rollout
    graphdef, params = nnx.split(trainer)
    tx = optax.sgd(0.0)
    step = compile_train_step(graphdef, tx, group_size=1, loss_cfg=LossConfig(), temperature=1.0)
    adv = jnp.asarray([1.0, -1.0, 0.5, -0.5])
    metrics = {}
    for replay in (True, False):
        batch = Batch.from_rollout(ro if replay else dataclasses.replace(ro, routes=None),
                                   adv, jnp.ones(4, bool))  # fmt: skip
        state = init_train_state(jax.tree.map(jnp.copy, params), tx)  # the step donates it
        _, metrics[replay] = step(state, batch)
    assert float(metrics[True]["router_differs"]) > 0.9
    assert float(metrics[True]["router_differs_tokens"]) >= float(metrics[True]["router_differs"])
    assert float(metrics[True]["mismatch"]) < 2e-5  # the trainer's log-probs are the sampler's
    assert float(metrics[False]["mismatch"]) > 1e-2
    assert "router_differs" not in metrics[False]  # nothing replayed, nothing to report


def test_the_slot_engine_records_the_same_experts_as_static_decoding(replay_rollout):
    from flax import nnx

    from jaxrl_scale.generation.engine import SlotEngine
    from jaxrl_scale.generation.sampler import Sampling, generate

    sampler, _, _ = replay_rollout
    static = generate(sampler, REPLAY_PROMPTS, max_new_tokens=6, temperature=0.0)
    engine = SlotEngine(nnx.graphdef(sampler), slots=2, prompt_len=8, n_new=6, repeat=1,
                        sampling=Sampling(0.0), eos_ids=(), pad_id=0, model_cfg=sampler.cfg,
                        key=jax.random.key(1))  # fmt: skip
    for i, p in enumerate(REPLAY_PROMPTS):
        engine.submit(i, p)
    done = []
    while engine.busy or engine.pending:  # 2 slots for 4 prompts: slots are reused
        done += engine.run(nnx.state(sampler), 0, 2)
    real = _real(static)
    for f in done:
        want = np.asarray(static.routes[f.request])[real[f.request]]
        np.testing.assert_array_equal(f.routes[real[f.request]], want)


@pytest.mark.parametrize("matmul", ["tiled", "ragged", "scan"])
def test_expert_parallel_layers_equal_one_device_with_each_shard_holding_its_experts(
    matmul, one_device_grads
):
    """An `expert` mesh axis: each shard holds E / 4 experts' matrices (never gathered), the
    rows come to them and go back inside the compiled step, and loss and gradients equal one
    device's; with fsdp and tensor beside it too (and then a share of the other weights)."""
    from jaxrl_scale.config import MeshConfig
    from jaxrl_scale.parallel import sharding

    cfg = _tiny_moe(num_experts=8, moe_matmul=matmul)
    state, loss, tokens, want, want_grads = one_device_grads(matmul)
    for shape in (dict(data=2, expert=4), dict(data=1, fsdp=2, expert=2, tensor=2)):
        mesh = sharding.make_mesh(MeshConfig(**shape))

        def on_mesh(state, tokens, mesh=mesh):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return jax.value_and_grad(loss)(state, tokens)

        layout = sharding.state_shardings(state, mesh)
        rows = sharding.batch_sharding(mesh)
        placed = (jax.device_put(state, layout), jax.device_put(tokens, rows))
        run = jax.jit(on_mesh, in_shardings=(layout, rows)).lower(*placed).compile()
        gate = placed[0]["layers"][0]["mlp"]["gate_kernel"].get_value()
        assert gate.addressable_shards[0].data.shape[0] == 8 // shape["expert"]
        # Outside the experts, on an FSDP mesh an expert shard is one more FSDP shard:
        # attention's matrices split their model dimension over fsdp x expert (else whole).
        q = placed[0]["layers"][0]["attn"]["q_kernel"].get_value()
        fsdp = shape.get("fsdp", 1)
        split = fsdp * shape["expert"] if fsdp > 1 else 1
        assert q.addressable_shards[0].data.shape[0] == cfg.hidden_size // split
        if shape["expert"] == 4:  # the experts' matrices are never gathered whole
            hlo = run.as_text()  # the program that runs below
            gathered = [ln for ln in hlo.splitlines() if "all-gather" in ln and "[8,16,8]" in ln]
            assert not gathered, gathered[:2]
        got, grads = run(*placed)
        np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_expert_parallel_generation_decodes_what_one_device_does_without_gathering_experts():
    """The sampler's programs trace on the generator's mesh (sharding.traced_on): each expert
    shard decodes with its own experts (no kernel gathered whole, as an MoE layer traced
    without the mesh would) and the tokens, log-probs and routes equal one device's."""
    from flax import nnx

    from jaxrl_scale.config import MeshConfig
    from jaxrl_scale.generation.sampler import Sampling, decode, generate, pad_prompts, prefill
    from jaxrl_scale.models.policy import init_policy
    from jaxrl_scale.parallel import sharding

    cfg = _tiny_moe(num_experts=8, moe_matmul="scan", router_replay=True)
    model = init_policy(cfg, seed=2)
    prompts = [[3, 4, 5], [6, 7], [8], [9, 10, 11, 12]] * 2
    kw = dict(max_new_tokens=5, temperature=1.0, key=jax.random.key(1))
    want = generate(model, prompts, **kw)
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=1, expert=4, tensor=1))
    got = generate(model, prompts, mesh=mesh, **kw)
    for name in ("completion_tokens", "behavior_logp", "routes"):
        a, b = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
    graphdef, params = nnx.split(model)
    params = jax.device_put(params, sharding.state_shardings(params, mesh))
    tokens, mask = jax.device_put(pad_prompts(prompts, 0), sharding.batch_sharding(mesh))
    state = prefill(graphdef, params, tokens, mask, jax.random.key(0), n_new=5,
                    interruption=None, mesh=mesh)  # fmt: skip
    hlo = decode.lower(
        graphdef, params, state, 0, 5, sampling=Sampling(1.0, 1.0, 0), eos_ids=(), pad_id=0,
        interruption=None, prompt_len=tokens.shape[1], mesh=mesh,
    ).compile().as_text()  # fmt: skip
    whole = [ln for ln in hlo.splitlines() if "all-gather" in ln and "[8,16,8]" in ln]
    assert not whole, whole[:2]


def test_pairs_held_elsewhere_contribute_nothing_whatever_ragged_dot_leaves_past_the_groups(
    monkeypatch,
):
    """Expert parallelism names experts held on other shards E or more (weight 0): those pairs
    sort past every group, where `ragged_dot` leaves its rows unspecified. A ragged_dot that
    fills them with NaN changes nothing: they are masked, not multiplied by their 0 weight."""
    from jaxrl_scale.models import moe

    e, n, k, d, f = 4, 6, 2, 8, 16
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (n, d))
    gate, up = (jax.random.normal(kk, (e, d, f)) * 0.3 for kk in keys[1:3])
    down = jax.random.normal(keys[3], (e, f, d)) * 0.3
    experts = jnp.array([[0, 5], [1, 2], [4, 3], [6, 0], [2, 1], [7, 7]])  # 4..7: elsewhere
    weights = jnp.where(experts < e, jax.random.uniform(keys[4], (n, k)), 0.0)
    want = moe.experts_dense(x, weights, experts, gate, up, down)  # drops ids past E

    real = jax.lax.ragged_dot

    def nan_past_the_groups(lhs, rhs, group_sizes, **kw):
        out = real(lhs, rhs, group_sizes, **kw)
        past = jnp.arange(out.shape[0]) >= jnp.sum(group_sizes)
        return jnp.where(past[:, None], jnp.nan, out)

    monkeypatch.setattr(jax.lax, "ragged_dot", nan_past_the_groups)
    got = moe.experts_ragged(x, weights, experts, gate, up, down)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
