"""The train step on hand-built batches: accumulation, skipped updates, the KL reference."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl_scale.config import LossConfig, ModelConfig
from jaxrl_scale.models.policy import Policy, token_logprobs
from jaxrl_scale.rl.step import Batch, compile_train_step, init_train_state

CFG = ModelConfig(
    architecture="qwen2",
    vocab_size=16,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
)
G = 4  # samples per prompt; 2 prompts per batch


def _setup(n_prompts=2):
    """n_prompts x G = 4 completions; the second prompt is left-padded, rows end unequally."""
    graphdef, params = nnx.split(Policy(CFG, rngs=nnx.Rngs(params=0)))
    rng = np.random.default_rng(0)
    b, length, n = n_prompts * G, 3, 3
    prompts = np.repeat(rng.integers(1, CFG.vocab_size, (n_prompts, length)), G, axis=0)
    prompt_mask = np.ones((b, length), bool)
    prompt_mask[G : 2 * G, 0] = False
    prompts[~prompt_mask] = 0
    tokens = rng.integers(1, CFG.vocab_size, (b, n))
    mask = np.ones((b, n), bool)
    mask[1, 2] = False  # rows of unequal length
    loss_mask = mask.astype(np.float32)
    logp = _full_logprobs(graphdef, params, prompts, prompt_mask, tokens, mask)
    behavior = logp + rng.normal(0, 0.1, (b, n)).astype(np.float32)  # rho != 1
    adv = jnp.asarray(np.resize([1.0, -1.0, 0.5, -0.5, 2.0, -1.0, -0.5, -0.5], b), jnp.float32)
    batch = Batch(*map(jnp.asarray, (prompts, prompt_mask, tokens, mask, loss_mask, behavior)), adv)
    return graphdef, params, batch


def _full_logprobs(graphdef, params, prompts, prompt_mask, tokens, mask):
    """Completion log-probs with every row run on its own (no prompt sharing)."""
    arrays = map(jnp.asarray, (prompts, prompt_mask, tokens, mask))
    return np.asarray(_row_logprobs(graphdef, params, *arrays))


@functools.partial(jax.jit, static_argnums=0)  # one program per batch shape, for every test
def _row_logprobs(graphdef, params, prompts, prompt_mask, tokens, mask):
    rows = jnp.concatenate([prompts, tokens], axis=1)
    row_mask = jnp.concatenate([prompt_mask, mask], axis=1)
    logp = token_logprobs(nnx.merge(graphdef, params), rows, mask_bt=row_mask)
    return logp[:, prompts.shape[1] :]


def _step(graphdef, tx, loss, **kw):
    return compile_train_step(graphdef, tx, group_size=G, loss_cfg=loss, temperature=1.0, **kw)


def _copy(tree):
    return jax.tree.map(lambda x: np.array(x), tree)


@pytest.mark.parametrize(
    "kind,aggregation", [("cispo", "prompt"), ("dapo", "token"), ("gspo", "sample")]
)
def test_accumulation_over_uneven_slices_equals_the_whole_batch(kind, aggregation):
    """Zero-variance filtering leaves slice 0 with one kept prompt and slice 1 with two: the
    accumulated update must still be the whole batch's, not a mean of per-slice means."""
    graphdef, params, batch = _setup(n_prompts=4)
    loss_mask = np.asarray(batch.loss_mask).copy()
    loss_mask[:G] = 0.0  # prompt 0's group had equal rewards
    batch = dataclasses.replace(
        batch, loss_mask=jnp.asarray(loss_mask), adv=batch.adv.at[:G].set(0.0)
    )
    tx = optax.sgd(1.0)
    loss = LossConfig(kind=kind, aggregation=aggregation)
    whole, m1 = _step(graphdef, tx, loss)(init_train_state(_copy(params), tx), batch)
    split, m2 = _step(graphdef, tx, loss, micro_batches=2)(
        init_train_state(_copy(params), tx), batch
    )
    for key in ("loss", "grad_norm", "kept_tokens", "rho_max", "mismatch", "seq_ratio_min"):
        np.testing.assert_allclose(m1[key], m2[key], rtol=2e-5, err_msg=key)
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(split.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    moved = [
        np.abs(np.asarray(a) - np.asarray(p)).max()
        for a, p in zip(jax.tree.leaves(whole.params), jax.tree.leaves(params), strict=True)
    ]
    assert max(moved) > 1e-4  # the step did something


def test_a_non_finite_loss_skips_the_update_and_counts():
    graphdef, params, batch = _setup()
    tx = optax.adamw(1e-3)
    step = _step(graphdef, tx, LossConfig())
    before = _copy(params)
    poisoned = dataclasses.replace(batch, adv=batch.adv.at[0].set(jnp.nan))
    state, metrics = step(init_train_state(_copy(params), tx), poisoned)
    assert int(metrics["skipped"]) == 1 and int(state.nonfinite) == 1 and int(state.step) == 0
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
    state, _ = step(state, poisoned)
    assert int(state.nonfinite) == 2
    state, metrics = step(state, batch)
    assert int(metrics["skipped"]) == 0 and int(state.nonfinite) == 0 and int(state.step) == 1


def test_grpo_kl_penalty_is_measured_against_the_frozen_reference():
    graphdef, params, batch = _setup()
    tx = optax.sgd(0.5)
    coef = 0.3
    step = _step(graphdef, tx, LossConfig(kind="grpo", kl_coef=coef))
    no_kl = _step(graphdef, tx, LossConfig(kind="grpo"))
    state = init_train_state(_copy(params), tx, reference=True)
    reference = _copy(params)

    # Step 1: the policy is the reference, so the penalty is exactly zero.
    _, plain = no_kl(init_train_state(_copy(params), tx), batch)
    state, m = step(state, batch)
    assert float(m["kl_ref"]) == 0.0
    np.testing.assert_allclose(m["loss"], plain["loss"], rtol=1e-6)

    # Step 2: k3 = exp(ref - logp) - (ref - logp) - 1 per token, averaged per prompt (the
    # default prompt aggregation: token mean within each prompt's tokens, then prompt mean).
    rows = (batch.prompt_tokens, batch.prompt_mask, batch.tokens, batch.mask)
    logp = _full_logprobs(graphdef, state.params, *rows)
    ref = _full_logprobs(graphdef, reference, *rows)
    d = ref - logp
    k3 = np.exp(d) - d - 1.0
    mask = np.asarray(batch.loss_mask)
    per_prompt = [
        (k3[p * G : (p + 1) * G] * mask[p * G : (p + 1) * G]).sum()
        / mask[p * G : (p + 1) * G].sum()
        for p in range(2)
    ]
    state, m = step(state, batch)
    assert float(m["kl_ref"]) > 0
    np.testing.assert_allclose(float(m["kl_ref"]), np.mean(per_prompt), rtol=1e-4)
    for a, b in zip(jax.tree.leaves(state.ref_params), jax.tree.leaves(reference), strict=True):
        np.testing.assert_array_equal(a, b)  # the reference never moves


def test_kl_coef_must_be_non_negative():
    from jaxrl_scale.config import ConfigError

    with pytest.raises(ConfigError, match="loss.kl_coef"):
        LossConfig(kind="grpo", kl_coef=-0.1)
