"""The slot engine (continuous batching) against the static sampler and a full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_FIXTURES
from flax import nnx

from jaxrl_scale.generation.engine import RowSampling, SlotEngine
from jaxrl_scale.generation.sampler import Sampling, generate
from jaxrl_scale.models.hf import load_pretrained
from jaxrl_scale.models.policy import token_logprobs

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [30], [40, 41, 42, 43, 44],
           [50, 51], [60, 61, 62, 63], [70], [80, 81, 82, 83, 84, 85]]  # fmt: skip
N_NEW = 12


@pytest.fixture(scope="module")
def qwen2():
    return load_pretrained(HF_FIXTURES / "qwen2")[0]


def _eos_ids(model):
    """Tokens that greedy decoding of PROMPTS produces early, made EOS: rows then end at
    different lengths, which is what makes slots free up at different steps."""
    ro = generate(model, PROMPTS, max_new_tokens=N_NEW, temperature=0.0)
    toks = np.asarray(ro.completion_tokens)
    return tuple(sorted({int(toks[i, 2 + i % 5]) for i in range(len(PROMPTS))}))


def _engine(model, *, slots, repeat=1, temperature=0.0, eos_ids=(), interruption=None):
    graphdef, _ = nnx.split(model)
    return SlotEngine(
        graphdef,
        slots=slots,
        prompt_len=16,
        n_new=N_NEW,
        repeat=repeat,
        sampling=Sampling(temperature),
        eos_ids=eos_ids,
        pad_id=0,
        model_cfg=model.cfg,
        key=jax.random.key(1),
        interruption=interruption,
    )


def _drain(engine, params, steps=3, version=0):
    out = []
    while engine.busy or engine.pending:
        out += engine.run(params, version, steps)
    return out


@pytest.mark.parametrize("repeat", [1, 2])
def test_greedy_continuous_decoding_equals_static(qwen2, repeat):
    eos = _eos_ids(qwen2)
    static = generate(qwen2, PROMPTS, max_new_tokens=N_NEW, temperature=0.0, eos_ids=eos)
    lengths = np.asarray(static.lengths)
    assert len(set(lengths.tolist())) > 2  # rows end at different steps
    engine = _engine(qwen2, slots=4, repeat=repeat, eos_ids=eos)  # fewer slots than rows
    for i, p in enumerate(PROMPTS):
        engine.submit(i, p)
    params = nnx.state(qwen2)
    done = _drain(engine, params)
    assert sorted((f.request, f.row) for f in done) == [
        (i, r) for i in range(len(PROMPTS)) for r in range(repeat)
    ]
    for f in done:
        i = f.request
        assert f.length == lengths[i]
        np.testing.assert_array_equal(f.tokens, np.asarray(static.completion_tokens[i]))
        np.testing.assert_array_equal(f.mask, np.asarray(static.completion_mask[i]))
        np.testing.assert_allclose(f.logp, np.asarray(static.behavior_logp[i]), atol=1e-5)
        assert f.finish_reason == int(static.finish_reason[i])
    assert engine.busy == 0 and engine.pending == 0


def test_a_reused_slot_sees_nothing_of_its_previous_occupant(qwen2):
    """Sampled rows through two slots, eight prompts: most rows run in a slot another row used
    before. The trainer's log-probs of each finished sequence (one full forward, no cache)
    equal the behaviour log-probs the engine recorded."""
    engine = _engine(qwen2, slots=2, temperature=1.0, eos_ids=_eos_ids(qwen2))
    for i, p in enumerate(PROMPTS):
        engine.submit(i, p)
    done = _drain(engine, nnx.state(qwen2), steps=2)
    assert len(done) == len(PROMPTS)
    seq = np.stack([np.concatenate([f.prompt, f.tokens]) for f in done])
    mask = np.stack([np.concatenate([f.prompt_mask, np.ones(N_NEW, bool)]) for f in done])
    full = nnx.jit(lambda model, seq, mask: token_logprobs(model, seq, mask_bt=mask))
    want = full(qwen2, jnp.asarray(seq), jnp.asarray(mask))[:, 16:]  # one compiled program
    got = np.stack([f.logp for f in done])
    keep = np.stack([f.mask for f in done]) > 0
    assert keep.sum() > len(PROMPTS)
    np.testing.assert_allclose(np.asarray(want)[keep], got[keep], atol=1e-5)


def test_each_token_records_the_version_that_sampled_it(qwen2):
    """New parameters between any two runs: tokens sampled after the swap carry the new
    version, and a row that spans the swap carries both."""
    engine = _engine(qwen2, slots=4, temperature=1.0)  # no EOS: every row runs N_NEW tokens
    for i, p in enumerate(PROMPTS[:4]):
        engine.submit(i, p)
    params = nnx.state(qwen2)
    assert engine.run(params, 0, 5) == []
    assert engine.run(params, 1, 4) == []
    assert engine.run(params, 2, N_NEW) == []  # the rows end during these steps
    assert engine.busy == 4
    done = engine.run(params, 3, N_NEW)  # and are handed back by the next call
    assert len(done) == 4 and engine.busy == 0
    for f in done:
        np.testing.assert_array_equal(f.versions, [0] * 5 + [1] * 4 + [2] * 3)
        assert f.finish_reason == 1  # length


def test_a_held_prompt_waits_for_its_version_and_holds_those_behind_it(qwen2):
    """`not_before`: a prompt is admitted only by a run whose version is at least that (the
    staleness bound of the step that will train it), however many slots are free, and the
    prompts queued behind it wait with it (admission stays in submission order)."""
    engine = _engine(qwen2, slots=4, temperature=1.0)
    engine.submit(0, PROMPTS[0])
    engine.submit(1, PROMPTS[1], not_before=2)
    engine.submit(2, PROMPTS[2])  # no bound of its own, but queued behind request 1
    params = nnx.state(qwen2)
    engine.run(params, 1, 3)
    assert engine.busy == 1 and engine.pending == 2
    engine.run(params, 2, 3)
    assert engine.busy == 3 and engine.pending == 0
    done = {f.request: f for f in _drain(engine, params, version=3)}
    assert sorted(done) == [0, 1, 2]
    assert done[0].versions[0] == 1
    for r in (1, 2):
        sampled = done[r].versions[done[r].mask > 0]
        assert sampled.min() == 2  # nothing from before the bound


def test_bad_requests_are_refused(qwen2):
    engine = _engine(qwen2, slots=2)
    engine.submit(0, [1, 2])
    with pytest.raises(ValueError, match="already submitted"):
        engine.submit(0, [3])
    with pytest.raises(ValueError, match="exceeds prompt_len"):
        engine.submit(1, list(range(1, 20)))
    with pytest.raises(ValueError, match="request 1: the prompt is empty"):
        engine.submit(1, [])
    with pytest.raises(ValueError, match="needs an engine with per_row_sampling"):
        engine.submit(1, [1, 2], sampling=RowSampling(0.5))
    assert engine.pending == 1  # none of the refused requests was queued
    with pytest.raises(ValueError, match="at least one group"):
        _engine(qwen2, slots=1, repeat=2)


def test_a_prompt_with_its_own_budget_stops_there(qwen2):
    engine = _engine(qwen2, slots=2, temperature=1.0)  # no EOS
    engine.submit(0, PROMPTS[0], max_new=3)
    engine.submit(1, PROMPTS[1])
    done = {f.request: f for f in _drain(engine, nnx.state(qwen2), steps=2)}
    assert done[0].length == 3 and done[0].mask.sum() == 3 and done[0].finish_reason == 1
    assert np.all(done[0].tokens[3:] == 0) and np.all(done[0].versions[3:] == -1)
    assert done[1].length == N_NEW
    with pytest.raises(ValueError, match="max_new"):
        engine.submit(2, PROMPTS[2], max_new=N_NEW + 1)


@pytest.mark.parametrize("mode", ["pipeline.mode=pipeline_rl,pipeline.lockstep=true",
                                  "pipeline.mode=sync",
                                  "pipeline.mode=pipeline_rl,mesh.data=-1"])  # fmt: skip
def test_training_on_the_slot_engine(mode, tmp_path):
    """A run whose generator is the slot engine with fewer slots than a batch has rows: on a
    batch sampled by the parameters that train on it, every behaviour log-prob equals the
    trainer's recomputation (no slot leaks a previous occupant's cache); the staleness bound
    holds, and sync stays on-policy."""
    from conftest import FAST, TINY_CONFIG

    from jaxrl_scale.config import load_config
    from jaxrl_scale.train import train

    extra = ["sampler.batching=continuous", "sampler.slots=8", "sampler.admit_every=2",
             "train.steps=4", "pipeline.max_staleness=2"]  # fmt: skip
    extra += mode.split(",")
    rows = train(load_config(TINY_CONFIG, [*FAST, *extra]), tmp_path)
    assert [r["step"] for r in rows] == list(range(5))
    for r in rows[1:]:
        assert r["gen_length_mean"] > 0
        assert r["staleness_max"] <= (0 if "sync" in mode else 2)
        if r["staleness_max"] == 0:  # same parameters on both sides: the log-probs agree
            assert r["mismatch_max"] < 1e-4
    assert any(r["staleness_max"] == 0 for r in rows[1:])


def test_the_slots_are_split_over_the_generator_mesh(tmp_path):
    from conftest import FAST, TINY_CONFIG

    from jaxrl_scale.config import load_config
    from jaxrl_scale.train import setup

    cfg = load_config(TINY_CONFIG, [*FAST, "mesh.data=-1", "sampler.batching=continuous",
                                    "sampler.slots=16"])  # fmt: skip
    run = setup(cfg, tmp_path)
    params = run.start.train.params
    ro = run.worker.rollouts(lambda chunk: (0, params), jax.random.key(0))
    assert ro.batch.behavior_logp.shape[0] == 16  # 4 prompts x 4
    # The batch waits on the host; the trainer places each device's rows when it takes it.
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(ro.batch))
    placed = run.worker.to_trainer(ro.batch)
    assert placed.tokens.addressable_shards[0].data.shape[0] == 2  # 16 rows over 8 devices
    state = run.worker.engine.state
    for x in (state.cache.k[0], state.tokens, state.done):
        assert x.sharding.mesh.devices.size == 8
        assert len(x.sharding.device_set) == 8 and x.addressable_shards[0].data.shape[0] == 2


def test_a_checkpoint_does_not_skip_the_batch_queued_ahead(tmp_path):
    """In pipeline_rl the next batch is drawn and queued while this one finishes; the
    curriculum a batch carries (what a checkpoint keeps) has its cursor before the queued
    batch, so a resumed run draws those prompts again instead of skipping them."""
    from conftest import FAST, TINY_CONFIG

    from jaxrl_scale.config import load_config
    from jaxrl_scale.train import setup

    cfg = load_config(TINY_CONFIG, [*FAST, "sampler.batching=continuous", "sampler.slots=8"])
    run = setup(cfg, tmp_path)
    params = run.start.train.params
    first = run.worker.rollouts(lambda chunk: (0, params), jax.random.key(0))
    second = run.worker.rollouts(lambda chunk: (0, params), jax.random.key(1))
    assert run.worker.curriculum.position == 12  # three batches of 4 drawn (one queued)
    assert int(first.curriculum["position"]) == 4 and int(second.curriculum["position"]) == 8
    assert not set(first.indices) & set(second.indices)
    assert run.worker.in_flight()[0] == 4  # the queued batch, reported at the end of a run


def test_forced_interruption_per_slot_equals_static(qwen2):
    """Each slot runs its own thinking budget: rows admitted at different steps are
    interrupted after the same number of their own tokens, as in a static batch."""
    from jaxrl_scale.generation.sampler import INTERRUPTED, Interruption

    intr = Interruption(token_ids=(9, 8), think_min=4, think_max=4, answer_budget=3)
    static = generate(qwen2, PROMPTS, max_new_tokens=N_NEW, temperature=0.0, interruption=intr)
    assert np.all(np.asarray(static.finish_reason) == INTERRUPTED)
    engine = _engine(qwen2, slots=3, interruption=intr)
    for i, p in enumerate(PROMPTS):
        engine.submit(i, p)
    done = _drain(engine, nnx.state(qwen2), steps=2)
    assert len(done) == len(PROMPTS)
    for f in done:
        np.testing.assert_array_equal(f.tokens, np.asarray(static.completion_tokens[f.request]))
        np.testing.assert_array_equal(f.mask, np.asarray(static.completion_mask[f.request]))
        assert f.finish_reason == INTERRUPTED and f.length == 4 + 2 + 3
        assert list(f.tokens[4:6]) == [9, 8] and f.mask[4:6].sum() == 0  # the inserted text


def test_static_waves_of_slots_rows_equal_one_batch(tmp_path):
    """`sampler.slots` below a batch's rows: static decoding runs waves of that many rows
    (greedy: the same tokens as one batch), and chunks are counted across the waves."""
    from conftest import FAST, TINY_CONFIG

    from jaxrl_scale.config import ConfigError, load_config
    from jaxrl_scale.train import setup

    def worker(*extra):
        cfg = load_config(TINY_CONFIG, [*FAST, "sampler.chunk_size=2", *extra])
        return setup(cfg, tmp_path / "-".join(extra or ["one"])).worker

    one, waves = worker(), worker("sampler.slots=4")
    params = setup(load_config(TINY_CONFIG, FAST), tmp_path / "p").start.train.params
    prompts = [[2, 3, 4], [5, 6], [7], [8, 9, 10]]
    args = dict(sampling=Sampling(0.0), n_new=4, repeat=2)
    a = one.generate(lambda c: (10 + c, params), prompts, jax.random.key(0), **args)
    b = waves.generate(lambda c: (10 + c, params), prompts, jax.random.key(0), **args)
    np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
    np.testing.assert_allclose(a.behavior_logp, b.behavior_logp, atol=1e-6)
    v = np.asarray(b.versions)  # rows 0-3: wave 1 (chunks 0, 1); rows 4-7: wave 2 (2, 3)
    expected = 10 + np.arange(4)[None] // 2 + 2 * (np.arange(8)[:, None] >= 4)
    np.testing.assert_array_equal(v[v >= 0], expected[v >= 0])
    assert (v[4:] >= 0).any()
    with pytest.raises(ConfigError, match="sampler.slots"):
        worker("sampler.slots=2", "train.group_size=4")


@pytest.mark.parametrize("repeat", [3, 4])
def test_greedy_decoding_on_a_mesh_equals_static_with_groups_cut_by_shards(qwen2, repeat):
    """Sixteen slots over 8 devices (2 per shard): every group of 3 or 4 rows is cut by shard
    edges, so a prompt is prefilled on each shard that holds one of its rows; every row still
    decodes exactly as in a static batch, and rows handed back free slots on every shard."""
    from jaxrl_scale.config import MeshConfig
    from jaxrl_scale.parallel.sharding import make_mesh, shard_module

    mesh = make_mesh(MeshConfig(data=8, fsdp=1, tensor=1))
    eos = _eos_ids(qwen2)
    static = generate(qwen2, PROMPTS, max_new_tokens=N_NEW, temperature=0.0, eos_ids=eos)
    graphdef, _ = nnx.split(qwen2)
    engine = SlotEngine(graphdef, slots=16, prompt_len=16, n_new=N_NEW, repeat=repeat,
                        sampling=Sampling(0.0), eos_ids=eos, pad_id=0, model_cfg=qwen2.cfg,
                        key=jax.random.key(1), mesh=mesh)  # fmt: skip
    for i, p in enumerate(PROMPTS):
        engine.submit(i, p)
    done = _drain(engine, nnx.state(shard_module(qwen2, mesh)), steps=2)
    assert sorted((f.request, f.row) for f in done) == [
        (i, r) for i in range(len(PROMPTS)) for r in range(repeat)
    ]
    for f in done:
        np.testing.assert_array_equal(f.tokens, np.asarray(static.completion_tokens[f.request]))
        np.testing.assert_allclose(f.logp, np.asarray(static.behavior_logp[f.request]), atol=1e-5)


def test_scanned_layers_prefill_and_admit_what_layer_by_layer_does():
    """A mixture of experts with model.scan_layers (`ModelConfig.scan_prompts`; a dense
    model's prompts run layer by layer): the static prefill and the slot engine's admission
    run the prompt through one scan of the layers (a stacked prompt-sized cache, widened per
    layer after); the tokens and log-probs equal the layer-by-layer model's, on one device
    and on a mesh."""
    import dataclasses

    from jaxrl_scale.config import MeshConfig
    from jaxrl_scale.models.config import ModelConfig
    from jaxrl_scale.models.policy import Policy
    from jaxrl_scale.parallel.sharding import make_mesh, shard_module

    cfg = ModelConfig(architecture="qwen3_moe", qk_norm=True, vocab_size=64, hidden_size=16,
                      intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)  # fmt: skip
    layered = Policy(cfg, rngs=nnx.Rngs(params=3))
    scanned = Policy(dataclasses.replace(cfg, scan_layers=True), rngs=nnx.Rngs(params=3))
    dense = dataclasses.replace(cfg, architecture="qwen3", num_experts=0, scan_layers=True)
    assert scanned.cfg.scan_prompts and not dense.scan_prompts
    prompts = [[t % 64 for t in p] for p in PROMPTS]
    eos = (1,)
    want = generate(layered, prompts, max_new_tokens=N_NEW, temperature=0.0, eos_ids=eos)
    got = generate(scanned, prompts, max_new_tokens=N_NEW, temperature=0.0, eos_ids=eos)
    np.testing.assert_array_equal(np.asarray(got.completion_tokens), want.completion_tokens)
    np.testing.assert_allclose(np.asarray(got.behavior_logp), want.behavior_logp, atol=1e-5)
    mesh = make_mesh(MeshConfig(data=8, fsdp=1, tensor=1))
    graphdef, _ = nnx.split(scanned)
    engine = SlotEngine(graphdef, slots=8, prompt_len=16, n_new=N_NEW, repeat=2,
                        sampling=Sampling(0.0), eos_ids=eos, pad_id=0, model_cfg=scanned.cfg,
                        key=jax.random.key(1), mesh=mesh)  # fmt: skip
    for i, p in enumerate(prompts):
        engine.submit(i, p)
    done = _drain(engine, nnx.state(shard_module(scanned, mesh)), steps=4)
    assert len(done) == 2 * len(prompts)
    for f in done:
        np.testing.assert_array_equal(f.tokens, np.asarray(want.completion_tokens[f.request]))
        np.testing.assert_allclose(f.logp, np.asarray(want.behavior_logp[f.request]), atol=1e-5)


def test_slots_that_do_not_split_over_the_mesh_are_refused(qwen2):
    from jaxrl_scale.config import MeshConfig
    from jaxrl_scale.parallel.sharding import make_mesh

    mesh = make_mesh(MeshConfig(data=8, fsdp=1, tensor=1))
    with pytest.raises(ValueError, match=r"sampler.slots: 12 does not split .* 8 batch shards"):
        _engine_on(qwen2, mesh, slots=12)


def _engine_on(model, mesh, *, slots):
    graphdef, _ = nnx.split(model)
    return SlotEngine(graphdef, slots=slots, prompt_len=16, n_new=N_NEW, repeat=1,
                      sampling=Sampling(0.0), eos_ids=(), pad_id=0, model_cfg=model.cfg,
                      mesh=mesh)  # fmt: skip


ADMISSION_SCRIPT = """
import json, jax
from flax import nnx
from jaxrl_scale.generation import engine
from jaxrl_scale.parallel import sharding
from jaxrl_scale.config import MeshConfig, ModelConfig
from jaxrl_scale.models.policy import Policy

cfg = ModelConfig(architecture="qwen3", vocab_size=2048, hidden_size=256, intermediate_size=512,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True,
                  tie_embeddings=False)
out = {}
for n in (4, 16):
    mesh = sharding.make_mesh(MeshConfig(data=n, fsdp=1, tensor=1), jax.devices()[:n])
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Policy(cfg, rngs=nnx.Rngs(0))))
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          state, sharding.state_shardings(state, mesh))
    slots = engine.abstract_slots(cfg, 8 * n, 64, 2048, mesh)
    compiled = engine.lower_admission(graphdef, params, slots, repeat=16, prompt_len=64,
                                      n_new=2048, interruption=None, mesh=mesh).compile()
    text = compiled.as_text()
    out[n] = {"temp": compiled.memory_analysis().temp_size_in_bytes,
              "collectives": sum(text.count(c) for c in ("all-gather", "all-reduce",
                                                          "all-to-all", "collective-permute"))}
print(json.dumps(out))
"""


def test_admission_bytes_per_device_stay_flat_as_generator_devices_grow():
    """The admission program (prefill + write into the slots) for 8 slots per device, groups
    of 16 rows, on 4 and on 16 devices: each device prefills and writes only its own rows, so
    its temporaries do not grow with the device count (were every slot's cache built on every
    device they would grow 4x), and no data crosses devices."""
    import json
    import os
    import subprocess
    import sys

    from conftest import xla_flags

    env = {**os.environ, "XLA_FLAGS": xla_flags(16)}
    done = subprocess.run([sys.executable, "-c", ADMISSION_SCRIPT], env=env, timeout=300,
                          capture_output=True, text=True, check=True)  # fmt: skip
    out = json.loads(done.stdout.strip().splitlines()[-1])
    small, large = out["4"], out["16"]
    assert large["temp"] <= 1.10 * small["temp"], out
    assert small["collectives"] == large["collectives"] == 0, out


def test_a_config_whose_slots_do_not_split_over_the_generator_is_refused():
    from conftest import FAST, TINY_CONFIG

    from jaxrl_scale.config import ConfigError, load_config
    from jaxrl_scale.parallel.sharding import check_divisible, make_meshes

    cfg = load_config(TINY_CONFIG, [*FAST, "mesh.data=-1", "sampler.slots=12"])
    with pytest.raises(ConfigError, match="sampler.slots: 12 does not split over the generator's"):
        check_divisible(cfg, *make_meshes(cfg))
    check_divisible(load_config(TINY_CONFIG, [*FAST, "mesh.data=-1", "sampler.slots=16"]),
                    *make_meshes(cfg))  # fmt: skip


def test_an_episode_goes_on_in_its_slot_as_a_static_prefill_of_its_context_would(qwen2):
    """A parked row resumed with an observation feeds it into its cache (no prefill) and its
    next turn is what greedy decoding of the whole context gives; other slots decode on."""
    graphdef, params = nnx.split(qwen2)
    engine = SlotEngine(graphdef, slots=4, prompt_len=16, n_new=2 * N_NEW + 4, repeat=1,
                        sampling=Sampling(0.0), eos_ids=(), pad_id=0, model_cfg=qwen2.cfg,
                        key=jax.random.key(1), episodes=True)  # fmt: skip
    for i, p in enumerate(PROMPTS[:3]):
        engine.submit(i, p, max_new=4 + i)  # turn 1: 4, 5, 6 tokens
    turns = {}
    while len(turns) < 3:
        for f in engine.run(params, 0, 3):
            turns[f.request] = f
    assert engine.busy == 3 and engine.decoding == 0  # parked, not freed
    # The first row to finish (parked while the others decode on) gets an empty
    # observation: its next turn follows its own last token.
    observation = [[], [93], [90, 91, 92]]
    for i, f in turns.items():
        assert f.length == 4 + i and (f.mask[: f.length] == 1).all()
        engine.resume(i, 0, observation[i], limit=f.length + len(observation[i]) + N_NEW)
    engine.submit(7, PROMPTS[3], max_new=N_NEW)  # a newcomer takes the free slot meanwhile
    done = {}
    while len(done) < 4:
        for f in engine.run(params, 1, 3):
            done[f.request] = f
    for i in range(3):
        f, first = done[i], turns[i]
        n1, obs = first.length, observation[i]
        context = PROMPTS[i] + first.tokens[:n1].tolist() + obs
        want = generate(qwen2, [context], max_new_tokens=N_NEW, temperature=0.0)
        second = f.tokens[n1 + len(obs) : f.length]
        assert f.length == n1 + len(obs) + N_NEW
        np.testing.assert_array_equal(f.tokens[:n1], first.tokens[:n1])
        np.testing.assert_array_equal(f.tokens[n1 : n1 + len(obs)], obs)
        np.testing.assert_array_equal(second, np.asarray(want.completion_tokens[0]))
        np.testing.assert_allclose(f.logp[n1 + len(obs) : f.length],
                                   np.asarray(want.behavior_logp[0]), atol=1e-5)  # fmt: skip
        # The observation is context: no mask, no log-prob, no version.
        assert (f.mask[n1 : n1 + len(obs)] == 0).all()
        assert (f.mask[n1 + len(obs) : f.length] == 1).all()
        assert (f.versions[:n1] == 0).all() and (f.versions[n1 : n1 + len(obs)] == -1).all()
        assert (f.versions[n1 + len(obs) : f.length] == 1).all()
        engine.release(i, 0)
    alone = generate(qwen2, [PROMPTS[3]], max_new_tokens=N_NEW, temperature=0.0)
    np.testing.assert_array_equal(done[7].tokens[:N_NEW], np.asarray(alone.completion_tokens[0]))
    engine.release(7, 0)
    assert engine.busy == 0 and not engine.prompts
    with pytest.raises(ValueError, match="not parked"):
        engine.release(7, 0)
    # A prompt's given rest must leave room to sample (it counts in max_new).
    with pytest.raises(ValueError, match="3 given tokens leave none of max_new = 3"):
        engine.submit(8, PROMPTS[0], max_new=3, given=[5, 6, 7])
    assert engine.pending == 0 and not engine.prompts


# --------------------------------------------------------------------------- a server's engine


def _server_engine(model, *, slots=4, prompt_len=16, top_logprobs=3):
    graphdef, _ = nnx.split(model)
    return SlotEngine(graphdef, slots=slots, prompt_len=prompt_len, n_new=N_NEW, repeat=1,
                      sampling=Sampling(1.0), eos_ids=(), pad_id=0, model_cfg=model.cfg,
                      per_row_sampling=True, top_logprobs=top_logprobs)  # fmt: skip


def _tokens(engine, params, requests, steps=3):
    """{request: Finished} of `requests` [(id, prompt, RowSampling)], submitted at once."""
    for i, prompt, rs in requests:
        engine.submit(i, prompt, sampling=rs)
    return {f.request: f for f in _drain(engine, params, steps=steps)}


def test_each_row_samples_with_its_own_settings_and_seed(qwen2):
    params = nnx.state(qwen2)
    hot = RowSampling(temperature=1.5, top_p=0.9, seed=(7, 0))
    # A seeded row's tokens are its seed's alone: decoded alone, beside other rows (greedy
    # and sampled, admitted before and after it), or admitted later, they are the same.
    alone = _tokens(_server_engine(qwen2), params, [(0, PROMPTS[0], hot)])[0]
    mixed = _tokens(
        _server_engine(qwen2, slots=2),
        params,
        [(5, PROMPTS[3], RowSampling(0.7, seed=(1, 1))), (6, PROMPTS[1], RowSampling(0.0)),
         (7, PROMPTS[2], RowSampling(1.0, seed=(2, 2))), (0, PROMPTS[0], hot)],
        steps=2,
    )  # fmt: skip
    np.testing.assert_array_equal(alone.tokens, mixed[0].tokens)
    np.testing.assert_allclose(alone.logp, mixed[0].logp, atol=1e-6)
    other = _tokens(_server_engine(qwen2), params,
                    [(0, PROMPTS[0], RowSampling(1.5, 0.9, seed=(8, 0)))])[0]  # fmt: skip
    assert not np.array_equal(alone.tokens, other.tokens)  # another seed, other tokens
    # Temperature 0 is greedy: the static sampler's tokens, beside sampled rows.
    static = generate(qwen2, [PROMPTS[1]], max_new_tokens=N_NEW, temperature=0.0)
    np.testing.assert_array_equal(mixed[6].tokens, np.asarray(static.completion_tokens[0]))


def test_log_probs_and_top_alternatives_are_the_sampled_distributions(qwen2):
    params = nnx.state(qwen2)
    requests = [(0, PROMPTS[3], RowSampling(0.0)), (1, PROMPTS[4], RowSampling(0.6, seed=(3, 4)))]
    done = _tokens(_server_engine(qwen2), params, requests)
    for request, temperature in ((0, 1.0), (1, 0.6)):  # greedy reports temperature-1 log-probs
        f = done[request]
        sequence = jnp.asarray([list(PROMPTS[request + 3]) + f.tokens.tolist()])
        logits = qwen2(sequence)[0, len(PROMPTS[request + 3]) - 1 : -1] / temperature
        want = jax.nn.log_softmax(logits, axis=-1)  # the reference: the full forward
        np.testing.assert_allclose(
            f.logp, np.take_along_axis(np.asarray(want), f.tokens[:, None], 1)[:, 0], atol=2e-4
        )
        best = np.argsort(-np.asarray(want), axis=-1)[:, :3]
        np.testing.assert_array_equal(f.top_ids, best)
        np.testing.assert_allclose(f.top_logp, np.take_along_axis(np.asarray(want), best, 1),
                                   atol=2e-4)  # fmt: skip
    np.testing.assert_array_equal(done[0].top_ids[:, 0], done[0].tokens)  # greedy: the best


def test_a_cancelled_request_frees_its_slots_at_once_and_is_never_handed_back(qwen2):
    params = nnx.state(qwen2)
    engine = _server_engine(qwen2, slots=2)
    rs = [RowSampling(1.0, seed=(i, 0)) for i in range(3)]
    for i in range(3):
        engine.submit(i, PROMPTS[i], sampling=rs[i])
    assert engine.run(params, 0, 2) == [] and engine.busy == 2 and engine.pending == 1
    partial = {r: t for r, _, first, t, *_ in engine.peek() if first == 0}
    assert sorted(partial) == [0, 1] and all(len(t) == 2 for t in partial.values())
    engine.cancel(0)  # decoding: its slot frees now
    engine.cancel(2)  # waiting: out of the queue
    assert engine.busy == 1 and engine.pending == 0
    done = _drain(engine, params)
    assert [f.request for f in done] == [1]
    np.testing.assert_array_equal(done[0].tokens[:2], partial[1])  # peek saw its prefix
    # The row left alone decoded as it would have without the cancelled ones beside it.
    again = _tokens(_server_engine(qwen2), params, [(1, PROMPTS[1], rs[1])])[1]
    np.testing.assert_array_equal(done[0].tokens, again.tokens)


def test_a_prompt_longer_than_the_prompt_columns_goes_on_as_given_tokens(qwen2):
    params = nnx.state(qwen2)
    prompt = PROMPTS[1]  # 10 tokens: 4 in the prompt columns, 6 given
    wide = _tokens(_server_engine(qwen2), params, [(0, prompt, RowSampling(0.0))])[0]
    narrow = _server_engine(qwen2, prompt_len=4)
    narrow.submit(0, prompt[:4], given=prompt[4:], sampling=RowSampling(0.0))
    [f] = _drain(narrow, params)
    assert f.mask[:6].sum() == 0 and f.mask[6:].all()  # given, then sampled
    np.testing.assert_array_equal(f.tokens[:6], prompt[4:])
    np.testing.assert_array_equal(f.tokens[6:], wide.tokens[: N_NEW - 6])
