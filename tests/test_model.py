import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_FIXTURES
from flax import nnx
from safetensors.numpy import load_file

from jaxrl_scale.config import RopeScalingConfig
from jaxrl_scale.models.hf import load_pretrained
from jaxrl_scale.models.policy import (
    completion_logprobs,
    init_policy,
    logprobs_from_hidden,
    rope_inv_freq,
    token_logprobs,
)

ARCHES = ["qwen2", "qwen3", "llama", "qwen3_moe"]


def _naive_logprobs(model, tokens, temperature=1.0, mask=None):
    logp = jax.nn.log_softmax(model(tokens, mask_bt=mask) / temperature, axis=-1)
    picked = jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(picked, ((0, 0), (1, 0)))


# The model's forward as one compiled program (its ops one by one compile one program each;
# test_jit_matches_eager compares the two).
_forward = nnx.jit(lambda model, tokens, mask=None: model(tokens, mask_bt=mask))


@functools.cache
def _pretrained(arch):
    """(the fixture checkpoint of `arch`, loaded once; the transformers reference arrays)."""
    model, _ = load_pretrained(HF_FIXTURES / arch)
    return model, load_file(str(HF_FIXTURES / arch / "reference.safetensors"))


@functools.cache
def _pretrained_logits(arch):
    """The `arch` checkpoint's logits of the reference tokens and of its left-padded rows, from
    one program (both parity tests read them)."""
    model, ref = _pretrained(arch)
    both = nnx.jit(lambda m, tokens, padded, mask: (m(tokens), m(padded, mask_bt=mask)))
    mask = jnp.asarray(ref["padded_mask"].astype(bool))
    out = both(model, jnp.asarray(ref["tokens"]), jnp.asarray(ref["padded_tokens"]), mask)
    return tuple(np.asarray(x) for x in out)


# --------------------------------------------------------------------------- HF parity


@pytest.mark.parametrize("arch", ARCHES)
def test_logits_match_transformers_reference(arch):
    _, ref = _pretrained(arch)
    logits = _pretrained_logits(arch)[0]
    assert logits.dtype == np.float32
    assert logits.shape == ref["logits"].shape
    assert np.abs(logits - ref["logits"]).max() < 1e-4
    np.testing.assert_array_equal(logits.argmax(-1), ref["logits"].argmax(-1))


@pytest.mark.parametrize("arch", ARCHES)
def test_left_padded_rows_match_transformers_reference(arch):
    _, ref = _pretrained(arch)
    mask = ref["padded_mask"].astype(bool)
    logits = _pretrained_logits(arch)[1]
    assert np.isfinite(logits).all()
    assert np.abs(logits - ref["padded_logits"])[mask].max() < 1e-4


def test_padding_does_not_change_real_tokens(tiny_model_config):
    model = init_policy(tiny_model_config, seed=1)
    tokens = jnp.array([[5, 9, 11, 3, 7]])
    padded = jnp.array([[0, 0, 5, 9, 11, 3, 7]])
    mask = jnp.array([[0, 0, 1, 1, 1, 1, 1]])
    np.testing.assert_allclose(
        _forward(model, padded, mask)[:, 2:], _forward(model, tokens), atol=1e-5
    )


def test_llama3_rope_scaling_by_hand():
    # head_dim 8, theta 10_000: inv_freq = 10000 ** (-[0, 2, 4, 6] / 8) = [1, 0.1, 0.01, 0.001];
    # wavelengths 2*pi/f = [6.28, 62.8, 628, 6283]. With original context 64, low factor 1, high
    # factor 4: low_wavelen 64, high_wavelen 16. f0 is high-frequency (kept), f2, f3 are
    # low-frequency (divided by factor 8), f1 is medium: smooth = (64 / 62.83 - 1) / 3 = 0.006226,
    # blended = (1 - smooth) * 0.1 / 8 + smooth * 0.1 = 0.0130448.
    scaling = RopeScalingConfig(factor=8, original_max_position_embeddings=64)
    got = np.asarray(rope_inv_freq(8, 10_000.0, scaling))
    smooth = (64 / (2 * np.pi / 0.1) - 1) / 3
    want = [1.0, (1 - smooth) * 0.1 / 8 + smooth * 0.1, 0.01 / 8, 0.001 / 8]
    np.testing.assert_allclose(got, want, rtol=1e-5)


# --------------------------------------------------------------------------- log-probs


@functools.cache
def _naive_qwen3_logprobs():
    """The qwen3 fixture's tokens and their log-probs at temperature 0.7 from the whole
    log-softmax (one reference for every chunk size)."""
    model, ref = _pretrained("qwen3")
    tokens = jnp.asarray(ref["tokens"])
    return tokens, nnx.jit(functools.partial(_naive_logprobs, temperature=0.7))(model, tokens)


@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
def test_token_logprobs_match_full_log_softmax(chunk):
    model, _ = _pretrained("qwen3")
    tokens, want = _naive_qwen3_logprobs()
    got = nnx.jit(functools.partial(token_logprobs, chunk_size=chunk, temperature=0.7))(
        model, tokens
    )
    assert got.shape == tokens.shape and got.dtype == jnp.float32
    assert np.all(np.asarray(got[:, 0]) == 0)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_token_logprobs_gradient_matches_naive(tiny_model_config):
    model = init_policy(tiny_model_config, seed=2)
    tokens = jax.random.randint(jax.random.key(0), (2, 11), 0, tiny_model_config.vocab_size)
    weights = jax.random.normal(jax.random.key(1), tokens.shape)

    def loss(fn):
        return lambda m: jnp.sum(fn(m) * weights)

    g_chunked = nnx.jit(nnx.grad(loss(lambda m: token_logprobs(m, tokens, chunk_size=3))))(model)
    g_naive = nnx.jit(nnx.grad(loss(lambda m: _naive_logprobs(m, tokens))))(model)
    for a, b in zip(jax.tree.leaves(g_chunked), jax.tree.leaves(g_naive), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def _grouped_rows(vocab):
    """2 prompts (the second left-padded) x 3 completions each, of unequal lengths."""
    rng = np.random.default_rng(7)
    prompts = rng.integers(1, vocab, (2, 5))
    prompt_mask = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], bool)
    prompts[~prompt_mask] = 0
    completions = rng.integers(1, vocab, (6, 4))
    lengths = np.array([4, 2, 3, 1, 4, 4])
    mask = np.arange(4)[None] < lengths[:, None]
    completions[~mask] = 0
    return prompts, prompt_mask, completions, mask


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_completion_logprobs_share_the_prompt_and_match_full_rows(tiny_model_config, arch):
    cfg = dataclasses.replace(tiny_model_config, architecture=arch, qk_norm=arch == "qwen3")
    model = init_policy(cfg, seed=4)
    prompts, prompt_mask, completions, mask = _grouped_rows(cfg.vocab_size)
    rows = np.concatenate([np.repeat(prompts, 3, axis=0), completions], axis=1)
    row_mask = np.concatenate([np.repeat(prompt_mask, 3, axis=0), mask], axis=1)
    weights = jax.random.normal(jax.random.key(3), completions.shape) * mask

    def shared(m):
        return completion_logprobs(m, prompts, prompt_mask, completions, mask, temperature=0.8)

    def full(m):  # every row on its own, naive log-softmax over the whole vocabulary
        return _naive_logprobs(m, jnp.asarray(rows), 0.8, jnp.asarray(row_mask))[:, 5:]

    def value_and_grad(logprobs):  # the log-probs and the gradient, one program
        def loss(m):
            logp = logprobs(m)
            return jnp.sum(logp * weights), logp

        (_, logp), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
        return logp, grads

    (got, g_shared), (want, g_full) = value_and_grad(shared), value_and_grad(full)
    assert got.shape == completions.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.where(mask, got, 0), np.where(mask, want, 0), atol=1e-5)
    for a, b in zip(jax.tree.leaves(g_shared), jax.tree.leaves(g_full), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_completion_logprobs_reject_rows_that_are_not_groups(tiny_model_config):
    model = init_policy(tiny_model_config, seed=4)
    prompts, prompt_mask, completions, mask = _grouped_rows(tiny_model_config.vocab_size)
    with pytest.raises(ValueError, match="5 completions do not split into groups over 2"):
        completion_logprobs(model, prompts, prompt_mask, completions[:5], mask[:5])


def test_jit_matches_eager(tiny_model_config):
    model = init_policy(tiny_model_config, seed=3)
    tokens = jax.random.randint(jax.random.key(2), (3, 9), 0, tiny_model_config.vocab_size)
    jitted = nnx.jit(lambda m, t: token_logprobs(m, t))(model, tokens)
    np.testing.assert_allclose(jitted, token_logprobs(model, tokens), atol=1e-6)


def test_logprob_temp_memory_is_bounded_as_length_grows():
    """XLA's compiled memory analysis of forward+backward at Qwen's vocabulary (V = 151,936):
    chunked temp memory stays flat as T grows 16x, far below one copy of the [B, T, V] logits."""
    vocab, d, chunk = 151_936, 64, 256

    def grad_fn(h, tokens, kernel):
        def loss(h, kernel):
            return logprobs_from_hidden(
                h, tokens, kernel, head_dtype="float32", temperature=1.0, chunk_size=chunk
            ).sum()

        return jax.grad(loss, argnums=(0, 1))(h, kernel)

    temps = {}
    for t in (512, 8192):
        args = (
            jax.ShapeDtypeStruct((1, t, d), jnp.float32),
            jax.ShapeDtypeStruct((1, t), jnp.int32),
            jax.ShapeDtypeStruct((d, vocab), jnp.float32),
        )
        temps[t] = jax.jit(grad_fn).lower(*args).compile().memory_analysis().temp_size_in_bytes
    full_logits_8192 = 8192 * vocab * 4
    assert temps[8192] < full_logits_8192 / 10, temps
    # What grows with T is O(T * D) (hidden states and their gradient), not O(T * V).
    assert temps[8192] - temps[512] < 16 * 8192 * d * 4, temps


# --------------------------------------------------------------------------- dtypes


def test_parameters_stay_float32_under_bf16_compute(tiny_model_config):
    cfg = dataclasses.replace(tiny_model_config, dtype="bfloat16")
    model = init_policy(cfg)
    assert {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype("float32")}
    tokens = jnp.arange(12).reshape(2, 6)
    logits = _forward(model, tokens)
    assert logits.dtype == jnp.float32
    ref = _forward(init_policy(tiny_model_config), tokens)
    np.testing.assert_allclose(logits, ref, atol=0.05)  # bf16 compute, close but not exact


def test_fp32_head_is_float32_accurate_and_bf16_head_is_not(tiny_model_config):
    """The FP32 head is float32 maths on float32 inputs, not bf16 logits cast afterwards."""
    base = dataclasses.replace(tiny_model_config, dtype="bfloat16", vocab_size=512)
    h = jax.random.normal(jax.random.key(0), (2, 5, base.hidden_size))
    errors = {}
    for head in ("float32", "bfloat16"):
        model = init_policy(dataclasses.replace(base, lm_head_dtype=head))
        exact = np.asarray(h, np.float64) @ np.asarray(model.head_kernel(), np.float64)
        logits = model.logits(h)
        assert logits.dtype == jnp.float32
        errors[head] = np.abs(np.asarray(logits) - exact).max()
    assert errors["float32"] < 1e-5
    assert errors["bfloat16"] > 100 * errors["float32"]


def _dots(hlo: str) -> list[str]:
    """The dot_general lines of a lowered StableHLO program."""
    return [line for line in hlo.splitlines() if "stablehlo.dot_general" in line]


def _head_dots(hlo: str, vocab: int) -> list[str]:
    """dot_generals producing [..., V] logits (the vocabulary head)."""
    return [d for d in _dots(hlo) if f"x{vocab}x" in d.split("->")[-1]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp32_head_requests_full_precision_in_the_lowered_program(tiny_model_config, dtype):
    """On GPUs DEFAULT float32 is TF32 and on TPUs one bf16 pass; only an explicit HIGHEST
    (read here from the program XLA receives) keeps the FP32 head float32 on every backend."""
    vocab = 96  # a size no other matmul in the model has
    for head in ("float32", "bfloat16"):
        cfg = dataclasses.replace(
            tiny_model_config, dtype=dtype, lm_head_dtype=head, vocab_size=vocab
        )
        graphdef, params = nnx.split(init_policy(cfg))
        tokens = jnp.ones((2, 8), jnp.int32)
        hlo = (
            jax.jit(lambda p, t: token_logprobs(nnx.merge(graphdef, p), t))  # noqa: B023
            .lower(params, tokens)
            .as_text()
        )
        heads = _head_dots(hlo, vocab)
        assert heads, hlo
        for line in heads:
            operands = line.split(":")[-1].split("->")[0]
            if head == "float32":
                assert "precision = [HIGHEST, HIGHEST]" in line, line
                assert "bf16" not in operands, line
            else:
                assert "HIGHEST" not in line and operands.count("bf16") == 2, line


def test_matmul_precision_reaches_every_matmul_of_sampler_and_trainer(tiny_model_config):
    """model.matmul_precision is applied identically in the decode step and the train step."""
    import optax

    from jaxrl_scale.config import LossConfig
    from jaxrl_scale.generation.sampler import Sampling, decode, prefill
    from jaxrl_scale.rl.step import Batch, compile_train_step, init_train_state

    counts = {}
    for precision in ("default", "highest"):
        cfg = dataclasses.replace(tiny_model_config, matmul_precision=precision)
        graphdef, params = nnx.split(init_policy(cfg))
        tokens, mask = jnp.ones((2, 4), jnp.int32), jnp.ones((2, 4), bool)
        state = prefill(
            graphdef,
            params,
            tokens,
            mask,
            jax.random.key(0),
            n_new=3,
            interruption=None,
            mesh=None,
            repeat=2,
        )
        decode_hlo = decode.lower(
            graphdef,
            params,
            state,
            0,
            3,
            sampling=Sampling(),
            eos_ids=(),
            pad_id=0,
            interruption=None,
            prompt_len=4,
        ).as_text()
        tx = optax.sgd(0.1)
        b = 4
        batch = Batch(
            prompt_tokens=jnp.ones((b, 4), jnp.int32),
            prompt_mask=jnp.ones((b, 4), bool),
            tokens=jnp.ones((b, 3), jnp.int32),
            mask=jnp.ones((b, 3), bool),
            loss_mask=jnp.ones((b, 3), jnp.float32),
            behavior_logp=jnp.zeros((b, 3)),
            adv=jnp.ones((b,)),
        )
        step = compile_train_step(
            graphdef, tx, group_size=2, loss_cfg=LossConfig(), temperature=1.0
        )
        train_hlo = step.lower(init_train_state(params, tx), batch).as_text()
        for name, hlo in (("decode", decode_hlo), ("train", train_hlo)):
            dots = _dots(hlo)
            assert dots
            counts[precision, name] = (
                sum("precision = [HIGHEST, HIGHEST]" in d for d in dots),
                len(dots),
            )
    for name in ("decode", "train"):
        highest, total = counts["highest", name]
        assert highest == total, (name, counts)
        default_highest, default_total = counts["default", name]
        assert default_total == total
        assert 0 < default_highest < total  # only the FP32 head asks for HIGHEST by default


def test_matmul_precision_needs_float32_compute():
    from jaxrl_scale.config import ConfigError, ModelConfig

    with pytest.raises(ConfigError, match="model.matmul_precision"):
        ModelConfig(dtype="bfloat16", matmul_precision="highest")
