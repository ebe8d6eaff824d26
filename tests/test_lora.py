"""LoRA: the adapted forward against peft, gradients against the full model's, training of the
adapters alone, adapter-only weight updates, PEFT import/export and merged export."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FAST, FIXTURES, HF_FIXTURES, TINY_CONFIG
from flax import nnx
from safetensors.numpy import load_file

from jaxrl_scale.config import ConfigError, LoRAConfig, ModelConfig, load_config
from jaxrl_scale.models import lora
from jaxrl_scale.models.hf import CheckpointError, load_pretrained, save_pretrained
from jaxrl_scale.models.peft import load_adapter, resolve_lora, save_adapter
from jaxrl_scale.models.policy import Policy, completion_logprobs
from jaxrl_scale.rl.losses import loss_sums, loss_weights
from jaxrl_scale.rl.step import Batch, compile_train_step, init_train_state
from jaxrl_scale.train import train

PEFT_FIXTURES = FIXTURES / "peft"
ADAPTERS = {"qwen3_r4": "qwen3", "qwen2_r4": "qwen2"}  # qwen2_r4 uses rslora


def _tiny(rank: int, **lora_fields) -> ModelConfig:
    return ModelConfig(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        qkv_bias=True,
        lora=LoRAConfig(rank=rank, **lora_fields) if rank else LoRAConfig(),
    )


def _with_random_b(model: Policy, scale: float = 0.1) -> Policy:
    """A trained-looking adapter: every B drawn at random (B = 0 leaves the base unchanged)."""
    for n, (_, _, module, prefix) in enumerate(lora.adapted_modules(model)):
        b = getattr(module, f"{prefix}_lora_b")
        b.set_value(scale * jax.random.normal(jax.random.key(n), b.get_value().shape))
    return model


def _peft_policy(name: str) -> Policy:
    """The fixture base with the fixture's PEFT adapter, loaded the way a run does."""
    folder = PEFT_FIXTURES / name
    model_lora = resolve_lora(LoRAConfig(init_from=str(folder)))
    model, _ = load_pretrained(HF_FIXTURES / ADAPTERS[name], lora=model_lora)
    graphdef, frozen, adapters = lora.split_policy(model, model.cfg)
    return lora.merge_policy(graphdef, load_adapter(folder, adapters, model.cfg), frozen)


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"rank": -1}, "model.lora.rank"),
        ({"rank": 4, "alpha": 0}, "model.lora.alpha"),
        ({"rank": 4, "targets": ("q_proj", "lm_head")}, "model.lora.targets"),
        ({"rank": 4, "targets": ()}, "model.lora.targets"),
        ({"base_dtype": "bfloat16"}, "model.lora.base_dtype"),
    ],
)
def test_bad_lora_values_name_the_key(fields, key):
    with pytest.raises(ConfigError, match=key):
        LoRAConfig(**fields)


def test_lora_from_yaml_overrides_and_groups():
    cfg = load_config(TINY_CONFIG, ["model.lora.rank=8", "model.lora.targets=[attention, up_proj]"])
    assert cfg.model.lora.projections == ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj")
    assert cfg.model.lora.scale == 32.0 / 8
    assert LoRAConfig(rank=16, alpha=8, rslora=True).scale == 8 / 4
    with pytest.raises(ConfigError, match="model.lora.rnak"):
        load_config(TINY_CONFIG, ["model.lora.rnak=8"])


# --------------------------------------------------------------------------- the forward


def test_lora_policy_starts_equal_to_its_base():
    base = Policy(_tiny(0), rngs=nnx.Rngs(params=3))
    adapted = Policy(_tiny(4), rngs=nnx.Rngs(params=3))
    _, frozen, adapters = lora.split_policy(adapted, adapted.cfg)
    for x, y in zip(jax.tree.leaves(nnx.state(base)), jax.tree.leaves(frozen), strict=True):
        np.testing.assert_array_equal(x, y)  # the same base as a rank-0 policy of this seed
    for path, v in nnx.to_flat_state(adapters):  # A drawn, B = 0...
        assert (float(jnp.abs(v.get_value()).max()) > 0) == path[-1].endswith("_lora_a")
    tokens = jnp.arange(24).reshape(2, 12) % 48
    np.testing.assert_array_equal(adapted(tokens), base(tokens))  # ...B = 0


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_peft_adapter_logits_match_peft(name):
    ref = load_file(str(PEFT_FIXTURES / name / "reference.safetensors"))
    model = _peft_policy(name)
    logits = np.asarray(model(jnp.asarray(ref["tokens"])))
    assert np.abs(logits - ref["logits"]).max() < 1e-4
    base_ref = load_file(str(HF_FIXTURES / ADAPTERS[name] / "reference.safetensors"))
    assert np.abs(base_ref["logits"] - ref["logits"]).max() > 0.5  # the adapter matters


def test_merged_export_loads_as_a_plain_checkpoint_with_peft_logits(tmp_path):
    name = "qwen3_r4"
    model = _peft_policy(name)
    _, tokenizer = load_pretrained(HF_FIXTURES / "qwen3")
    save_pretrained(model, tokenizer, tmp_path / "merged")
    hf = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3ForCausalLM"]  # a plain checkpoint, no adapter keys
    merged, _ = load_pretrained(tmp_path / "merged")
    assert not merged.cfg.lora.enabled
    ref = load_file(str(PEFT_FIXTURES / name / "reference.safetensors"))
    logits = np.asarray(merged(jnp.asarray(ref["tokens"])))
    assert np.abs(logits - ref["logits"]).max() < 1e-4


def test_adapter_export_has_peft_layout_and_round_trips(tmp_path):
    name = "qwen3_r4"
    model = _peft_policy(name)
    _, _, adapters = lora.split_policy(model, model.cfg)
    out = save_adapter(adapters, model.cfg, tmp_path / "adapter", base="tests/fixtures/hf/qwen3")
    ours, theirs = (
        load_file(str(f / "adapter_model.safetensors")) for f in (out, PEFT_FIXTURES / name)
    )
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    for k in theirs:  # the same numbers under the same names
        np.testing.assert_allclose(ours[k], theirs[k], rtol=0, atol=0)
    config = json.loads((out / "adapter_config.json").read_text())
    ref = json.loads((PEFT_FIXTURES / name / "adapter_config.json").read_text())
    for key in ("peft_type", "r", "lora_alpha", "use_rslora", "bias", "task_type"):
        assert config[key] == ref[key], key
    assert sorted(config["target_modules"]) == sorted(ref["target_modules"])


def test_peft_folder_errors_name_what_is_wrong(tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    with pytest.raises(CheckpointError, match="adapter_config.json: missing"):
        resolve_lora(LoRAConfig(init_from=str(folder)))
    ref = json.loads((PEFT_FIXTURES / "qwen3_r4" / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**ref, "use_dora": True}))
    with pytest.raises(CheckpointError, match="use_dora"):
        resolve_lora(LoRAConfig(init_from=str(folder)))
    with pytest.raises(ConfigError, match="model.lora.rank"):
        resolve_lora(LoRAConfig(rank=8, init_from=str(PEFT_FIXTURES / "qwen3_r4")))
    # A tensor missing from the weights file is named.
    (folder / "adapter_config.json").write_text(json.dumps(ref))
    weights = load_file(str(PEFT_FIXTURES / "qwen3_r4" / "adapter_model.safetensors"))
    gone = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    from safetensors.numpy import save_file

    save_file(
        {k: v for k, v in weights.items() if k != gone}, str(folder / "adapter_model.safetensors")
    )
    model, _ = load_pretrained(
        HF_FIXTURES / "qwen3", lora=resolve_lora(LoRAConfig(init_from=str(folder)))
    )
    _, _, adapters = lora.split_policy(model, model.cfg)
    with pytest.raises(CheckpointError, match="layers.1.mlp.up_proj.lora_B"):
        load_adapter(folder, adapters, model.cfg)


# --------------------------------------------------------------------------- gradients


def _batch(cfg: ModelConfig, p: int = 2, g: int = 2, n: int = 6, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    b = p * g
    prompt = np.repeat(rng.integers(1, cfg.vocab_size, (p, 5)), g, axis=0)
    lengths = rng.integers(2, n + 1, b)
    mask = np.arange(n)[None, :] < lengths[:, None]
    return Batch(
        prompt_tokens=jnp.asarray(prompt, jnp.int32),
        prompt_mask=jnp.ones((b, 5), bool),
        tokens=jnp.asarray(rng.integers(1, cfg.vocab_size, (b, n)), jnp.int32),
        mask=jnp.asarray(mask),
        loss_mask=jnp.asarray(mask, jnp.float32),
        behavior_logp=jnp.asarray(-rng.uniform(1, 4, (b, n)), jnp.float32),
        adv=jnp.asarray(rng.normal(size=b), jnp.float32),
    )


def _objective(model: Policy, batch: Batch, group_size: int):
    """The run's loss of `batch` under `model`, through the public pieces the step uses."""
    loss_cfg = load_config(TINY_CONFIG).loss
    logp = completion_logprobs(
        model, batch.prompt_tokens[::group_size], batch.prompt_mask[::group_size],
        batch.tokens, batch.mask,
    )  # fmt: skip
    weights = loss_weights(batch.loss_mask, group_size, loss_cfg.kind, loss_cfg.aggregation)
    loss, _ = loss_sums(
        logp, batch.behavior_logp, batch.adv, batch.loss_mask, weights, loss_cfg.kind, None,
        **loss_cfg.hyper(),
    )  # fmt: skip
    return loss


def _adapter_grads(graphdef, adapters, frozen, batch: Batch, group_size: int):
    """dL/d(adapters) of `_objective`, one compiled program (op by op, each op would compile
    on its own): the tests that take it of the same config and batch compile it once."""
    loss = lambda a, f: _objective(lora.merge_policy(graphdef, a, f), batch, group_size)  # noqa: E731
    return jax.jit(jax.grad(loss))(adapters, frozen)


def test_adapter_gradients_are_the_full_gradient_projected():
    """At B = 0, dL/dB = s A^T dL/dW (W's full fine-tuning gradient) and dL/dA = 0: the
    adapted forward and its backward, checked against the rank-0 model's own gradient."""
    cfg = _tiny(4, alpha=8)
    batch = _batch(cfg)
    full = Policy(_tiny(0), rngs=nnx.Rngs(params=1))
    graphdef0, params0 = nnx.split(full)
    g_full = jax.jit(jax.grad(lambda p: _objective(nnx.merge(graphdef0, p), batch, 2)))(params0)
    adapted = Policy(cfg, rngs=nnx.Rngs(params=1))
    graphdef, frozen, adapters = lora.split_policy(adapted, cfg)
    g_lora = _adapter_grads(graphdef, adapters, frozen, batch, 2)
    flat_full, flat_lora = dict(nnx.to_flat_state(g_full)), dict(nnx.to_flat_state(g_lora))
    flat_a = dict(nnx.to_flat_state(adapters))
    checked = 0
    for path, g_b in flat_lora.items():
        if not path[-1].endswith("_lora_b"):
            np.testing.assert_array_equal(g_b.get_value(), 0.0)  # dL/dA at B = 0
            continue
        prefix = path[-1].removesuffix("_lora_b")
        g_w = np.asarray(flat_full[(*path[:-1], f"{prefix}_kernel")].get_value())
        a = np.asarray(flat_a[(*path[:-1], f"{prefix}_lora_a")].get_value())
        a2 = a.reshape(-1, a.shape[-1])
        expected = cfg.lora.scale * a2.T @ g_w.reshape(a2.shape[0], -1)
        got = np.asarray(g_b.get_value()).reshape(expected.shape)
        np.testing.assert_allclose(got, expected, rtol=2e-4, atol=1e-7)
        checked += 1
    assert checked == 2 * 7  # every projection of both layers


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_train_step_updates_the_adapters_alone(micro_batches):
    cfg = _tiny(4, alpha=8)  # test_adapter_gradients_...: the same gradient program
    batch = _batch(cfg, p=2, g=2)
    graphdef, frozen, adapters = lora.split_policy(Policy(cfg, rngs=nnx.Rngs(params=2)), cfg)
    frozen_before = [np.asarray(x) for x in jax.tree.leaves(frozen)]
    tx = optax.adamw(1e-2)
    state = init_train_state(jax.tree.map(jnp.copy, adapters), tx)  # the step donates it
    # Optimizer state: Adam's two moments over the adapters only (plus a step count).
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * sum(x.size for x in jax.tree.leaves(adapters))
    loss_cfg = load_config(TINY_CONFIG).loss
    step = compile_train_step(graphdef, tx, group_size=2, loss_cfg=loss_cfg, temperature=1.0,
                              micro_batches=micro_batches)  # fmt: skip
    new, metrics = step(state, batch, frozen)
    assert int(metrics["skipped"]) == 0 and np.isfinite(float(metrics["loss"]))
    for x, y in zip(frozen_before, jax.tree.leaves(frozen), strict=True):
        np.testing.assert_array_equal(x, y)  # the base: not donated, not changed
    moved = {
        p[-1][-6:]
        for p, v in nnx.to_flat_state(new.params)
        if float(jnp.abs(v.get_value()).max()) > 0
    }
    assert "lora_b" in moved  # B left zero: the first step's gradient reaches B

    # The same update, computed without the train step: one AdamW step on the gradient.
    grads = _adapter_grads(graphdef, adapters, frozen, batch, 2)

    @jax.jit  # one program (op by op, each op would compile on its own)
    def adamw_step(grads, adapters):
        updates, _ = tx.update(grads, tx.init(adapters), adapters)
        return optax.apply_updates(adapters, updates)

    expected = adamw_step(grads, adapters)
    for x, y in zip(jax.tree.leaves(expected), jax.tree.leaves(new.params), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_bfloat16_base_halves_the_layers_and_keeps_the_fp32_head():
    cfg = dataclasses.replace(_tiny(4), tie_embeddings=False)
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, base_dtype="bfloat16"))
    graphdef, frozen, adapters = lora.split_policy(Policy(cfg, rngs=nnx.Rngs(params=0)), cfg)
    dtypes = {"/".join(map(str, p)): v.get_value().dtype for p, v in nnx.to_flat_state(frozen)}
    assert dtypes["layers/0/attn/q_kernel"] == jnp.bfloat16
    assert dtypes["layers/1/mlp/down_kernel"] == jnp.bfloat16
    assert dtypes["lm_head"] == jnp.float32 and dtypes["embedding"] == jnp.float32
    assert (
        dtypes["layers/0/attn_norm"] == jnp.float32
        and dtypes["layers/0/attn/q_bias"] == jnp.float32
    )
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(adapters))
    logits = lora.merge_policy(graphdef, adapters, frozen)(jnp.ones((1, 4), jnp.int32))
    assert logits.dtype == jnp.float32


# --------------------------------------------------------------------------- runs


def _adapter_bytes(cfg: ModelConfig) -> int:
    """Float32 bytes of rank-r adapters on every projection, from the shapes by hand."""
    d, f, r = cfg.hidden_size, cfg.intermediate_size, cfg.lora.rank
    h, k, e = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    per_layer = sum(i + o for i, o in [(d, h * e), (d, k * e), (d, k * e), (h * e, d),
                                       (d, f), (d, f), (f, d)])  # fmt: skip
    return 4 * r * per_layer * cfg.num_layers


# The two LoRA runs' shared settings, so that the second reuses the first's compiled programs
# (model, warm start, eval, train step). One warm-start step: a second compiles its step again
# (the optimizer state comes back in other shardings than tx.init's), and neither test looks at
# the warm start.
LORA_RUN = ["model.lora.rank=4", "model.matmul_precision=highest", "warm_start.steps=1"]


def test_pipeline_rl_run_sends_adapters_only_and_logprobs_match(tmp_path):
    cfg = load_config(TINY_CONFIG, [*FAST, *LORA_RUN, "pipeline.mode=pipeline_rl",
                                    "train.steps=3"])  # fmt: skip
    rows = train(cfg, tmp_path)
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 3
    assert all(r["weight_update_bytes"] == _adapter_bytes(cfg.model) for r in steps)
    # The generator decodes base + adapters as the trainer computes them: float32 rounding.
    assert max(r["mismatch_max"] for r in steps) < 1e-4
    full = load_config(TINY_CONFIG, [*FAST, "pipeline.mode=pipeline_rl", "train.steps=1"])
    full_rows = train(full, tmp_path / "full")
    assert full_rows[-1]["weight_update_bytes"] > 4 * steps[0]["weight_update_bytes"]


def test_lora_checkpoint_exports_and_refuses_another_base(tmp_path):
    from jaxrl_scale.cli import main
    from jaxrl_scale.rl.checkpoint import CheckpointMismatch
    from jaxrl_scale.train import setup

    out = tmp_path / "run"  # export writes outside it

    args = [*FAST, *LORA_RUN, "pipeline.mode=sync", "train.steps=2", "checkpoint.every=2"]
    train(load_config(TINY_CONFIG, args), out)
    run = setup(load_config(TINY_CONFIG, args), out)  # the same base: resumes
    assert run.resumed and run.start.step == 2
    # Export: a merged Hugging Face folder and the adapters as a PEFT folder.
    assert main(["export", str(out), "--out", str(tmp_path / "hf"),
                 "--peft", str(tmp_path / "adapter")]) == 0  # fmt: skip
    adapted = lora.merge_policy(run.worker.graphdef, run.start.train.params, run.frozen)
    merged, _ = load_pretrained(tmp_path / "hf")
    tokens = jnp.arange(20).reshape(2, 10) % run.cfg.model.vocab_size
    np.testing.assert_allclose(merged(tokens), adapted(tokens), atol=1e-5)
    reloaded = load_adapter(tmp_path / "adapter", run.start.train.params, run.cfg.model)
    for x, y in zip(
        jax.tree.leaves(reloaded), jax.tree.leaves(run.start.train.params), strict=True
    ):
        np.testing.assert_array_equal(x, y)
    run.checkpointer.close()
    with pytest.raises(CheckpointMismatch, match="another base"):
        setup(load_config(TINY_CONFIG, [*args, "seed=7"]), out)
    with pytest.raises(CheckpointMismatch, match="does not make"):  # full FT vs adapters
        setup(load_config(TINY_CONFIG, [a for a in args if "lora" not in a]), out)


def test_run_starts_from_a_peft_adapter_on_a_hugging_face_base(tmp_path):
    folder = PEFT_FIXTURES / "qwen3_r4"
    from jaxrl_scale.train import setup

    overrides = [f"model.init_from={HF_FIXTURES / 'qwen3'}", f"model.lora.init_from={folder}"]
    cfg = load_config(TINY_CONFIG, [*FAST, *overrides, "pipeline.mode=sync"])
    run = setup(cfg, tmp_path)
    assert run.cfg.model.lora.rank == 4 and run.cfg.model.lora.alpha == 8
    ref = load_file(str(folder / "reference.safetensors"))
    model = lora.merge_policy(run.worker.graphdef, run.start.train.params, run.frozen)
    logits = np.asarray(model(jnp.asarray(ref["tokens"])))
    assert np.abs(logits - ref["logits"]).max() < 1e-4


PRE_LORA = "b14131a"  # the last commit before model.lora


def _pre_lora_rows(tmp_path) -> dict:
    """The pre-LoRA commit's run (tests/fixtures/make_rank0_reference.py) on this machine,
    its package and config taken from the repository's history; the stored copy, computed on
    another machine, where the checkout has no history (a tarball, a shallow clone)."""
    root = FIXTURES.parent.parent
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", PRE_LORA, "jaxrl_scale", "configs"],
        capture_output=True, timeout=60,
    )  # fmt: skip
    if archive.returncode != 0:
        warnings.warn(f"no commit {PRE_LORA} here: comparing with the stored rows", stacklevel=2)
        return json.loads((FIXTURES / "rank0_reference.json").read_text())
    tree, out = tmp_path / "pre-lora", tmp_path / "pre-lora.json"
    tree.mkdir()
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True, timeout=60)
    script = FIXTURES / "make_rank0_reference.py"
    env = {**os.environ, "JAXRL_TREE": str(tree)}
    done = subprocess.run(
        [sys.executable, str(script), str(out)], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_rank_zero_reproduces_the_numbers_from_before_lora(tmp_path):
    """model.lora.rank = 0 is the code path from before LoRA existed: the same run's metrics
    as that commit's code gives on this machine (`_pre_lora_rows`). Counts (tokens sampled,
    rows kept) are equal; floats agree to a relative 1e-2 (the two programs are not compiled
    from identical HLO, and 40 warm-start steps amplify their rounding: measured 5e-5 on
    grad_norm on an Intel Sapphire Rapids, 3e-3 on an AMD EPYC). A stored copy of the rows
    from one machine is not the reference: XLA's CPU code sums in other orders on other
    processors, and a token sampled once more or less changes every later count."""
    ref = _pre_lora_rows(tmp_path)
    # The reference trained padded steps (packing came later; auto may pack these batches).
    overrides = [*ref["overrides"], "model.lora.rank=0", "train.packing=false"]
    rows = train(load_config(TINY_CONFIG, overrides), tmp_path)
    assert len(rows) == len(ref["rows"])
    for got, want in zip(rows, ref["rows"], strict=True):
        assert set(want) <= set(got)
        for key, value in want.items():
            if isinstance(value, float):
                assert got[key] == pytest.approx(value, rel=1e-2, abs=2e-6), (want["step"], key)
            else:
                assert got[key] == value, (want["step"], key)
    assert any(r.get("grad_norm", 0) > 0 for r in rows)  # the run learned something
