import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_FIXTURES
from flax import nnx

from jaxrl_scale.config import MeshConfig
from jaxrl_scale.generation.sampler import (
    Interruption,
    Sampling,
    decode,
    generate,
    pad_prompts,
    prefill,
    prompt_width,
    sample_token,
    to_rollout,
)
from jaxrl_scale.models.hf import load_pretrained
from jaxrl_scale.models.policy import for_generation, token_logprobs
from jaxrl_scale.parallel import sharding

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [30], [40, 41, 42, 43, 44]]
N = 12  # new tokens: the tests decoding PROMPTS share its compiled prefill (and decode)


@pytest.fixture(scope="module")
def qwen2():
    return load_pretrained(HF_FIXTURES / "qwen2")[0]


_argmax_forward = nnx.jit(lambda m, t: jnp.argmax(m(t), axis=-1))


def _greedy_reference(model, prompt, n, width):
    """Argmax of a full forward pass (no cache) at each step. The buffer is right-padded to a
    fixed `width` (one compiled forward for every prompt), which causal attention makes
    invisible to the positions already filled."""
    buf = np.zeros((1, width), np.int32)
    buf[0, : len(prompt)] = prompt
    for i in range(len(prompt), len(prompt) + n):
        buf[0, i] = int(_argmax_forward(model, jnp.asarray(buf))[0, i - 1])
    return list(buf[0, len(prompt) : len(prompt) + n])


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_equals_stepwise_argmax_of_full_forward(arch):
    model, _ = load_pretrained(HF_FIXTURES / arch)
    ro = generate(model, PROMPTS, max_new_tokens=N, temperature=0.0)
    width = max(map(len, PROMPTS)) + N
    for i, prompt in enumerate(PROMPTS):
        want = _greedy_reference(model, prompt, N, width)
        assert list(np.asarray(ro.completion_tokens[i])) == want
    assert ro.finish_names() == ["length"] * 4
    assert np.all(np.asarray(ro.completion_mask) == 1)


def test_behaviour_logprobs_equal_recomputed_token_logprobs(qwen2):
    ro = generate(qwen2, PROMPTS, max_new_tokens=N, temperature=0.7, key=jax.random.key(3))
    # Recompute on the finished sequences: left-padded prompt + completion, one forward pass.
    seq = jnp.concatenate([ro.prompt_tokens, ro.completion_tokens], axis=1)
    mask = jnp.concatenate([ro.prompt_mask, jnp.ones_like(ro.completion_mask, bool)], axis=1)
    score = nnx.jit(lambda m, t, mask: token_logprobs(m, t, mask_bt=mask, temperature=0.7))
    want = score(qwen2, seq, mask)[:, ro.prompt_tokens.shape[1] :]
    assert float(jnp.abs(want - ro.behavior_logp).max()) < 1e-5
    assert np.all(np.asarray(ro.versions) == 0)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # tied + biases; untied + q/k norms
def test_generator_parameters_in_the_compute_dtype_sample_the_same_tokens(arch):
    model, _ = load_pretrained(HF_FIXTURES / arch, dtype="bfloat16")
    graphdef, params = nnx.split(model)
    kw = dict(max_new_tokens=N, temperature=1.0, key=jax.random.key(5))
    want = generate(model, PROMPTS, **kw)
    gen = for_generation(params, model.cfg)
    kept = {"final_norm", "attn_norm", "mlp_norm", "q_norm", "k_norm", "lm_head"}
    if model.cfg.tie_embeddings:
        kept.add("embedding")  # the FP32 head's kernel
    for path, x in jax.tree_util.tree_flatten_with_path(gen)[0]:
        name = next(k.key for k in reversed(path) if isinstance(getattr(k, "key", None), str))
        assert x.dtype == (jnp.float32 if name in kept else jnp.bfloat16), path
    # The train step donates the trainer's parameters: the generator's copy must not need them.
    for x in jax.tree.leaves(params):
        x.delete()
    got = generate(nnx.merge(graphdef, gen), PROMPTS, **kw)
    np.testing.assert_array_equal(got.completion_tokens, want.completion_tokens)
    np.testing.assert_array_equal(got.behavior_logp, want.behavior_logp)


def test_chunked_decoding_gives_the_same_tokens(qwen2):
    kw = dict(max_new_tokens=N, temperature=1.0, key=jax.random.key(7))
    whole = generate(qwen2, PROMPTS, **kw)
    for chunk in (1, 5):
        part = generate(qwen2, PROMPTS, chunk_size=chunk, **kw)
        np.testing.assert_array_equal(part.completion_tokens, whole.completion_tokens)
        np.testing.assert_array_equal(part.behavior_logp, whole.behavior_logp)


def test_same_key_same_samples_other_key_differs(qwen2):
    a = generate(qwen2, PROMPTS, max_new_tokens=N, key=jax.random.key(1))
    b = generate(qwen2, PROMPTS, max_new_tokens=N, key=jax.random.key(1))
    c = generate(qwen2, PROMPTS, max_new_tokens=N, key=jax.random.key(2))
    np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
    assert not np.array_equal(a.completion_tokens, c.completion_tokens)


def test_in_flight_weight_swap_keeps_cache_and_tags_versions(qwen2):
    graphdef, params = nnx.split(qwen2)
    newer = jax.tree.map(lambda x: x * 1.5, params)  # a different policy, same shapes
    tokens, mask = (jnp.asarray(x) for x in pad_prompts(PROMPTS, 0))
    static = dict(
        sampling=Sampling(temperature=0.0),
        eos_ids=(),
        pad_id=0,
        interruption=None,
        prompt_len=tokens.shape[1],
    )
    state = prefill(
        graphdef, params, tokens, mask, jax.random.key(0), n_new=N, interruption=None, mesh=None
    )
    state = decode(graphdef, params, state, 0, 4, **static)  # 4 tokens from version 0
    state = decode(graphdef, newer, state, 1, N, **static)  # the rest from version 1
    swapped = to_rollout(tokens, mask, state)
    np.testing.assert_array_equal(swapped.versions, np.array([[0] * 4 + [1] * (N - 4)] * 4))
    unswapped = generate(qwen2, PROMPTS, max_new_tokens=N, temperature=0.0)
    np.testing.assert_array_equal(
        swapped.completion_tokens[:, :4], unswapped.completion_tokens[:, :4]
    )
    assert not np.array_equal(swapped.completion_tokens[:, 4:], unswapped.completion_tokens[:, 4:])


def test_eos_stops_rows_and_nothing_is_generated_past_it(qwen2):
    greedy = np.asarray(
        generate(qwen2, PROMPTS, max_new_tokens=N, temperature=0.0).completion_tokens
    )
    eos = int(greedy[1, 2])  # row 1 emits this at step 2 (and maybe earlier in other rows)
    ro = generate(qwen2, PROMPTS, max_new_tokens=N, temperature=0.0, eos_ids=[eos], pad_id=1)
    tokens, mask = np.asarray(ro.completion_tokens), np.asarray(ro.completion_mask)
    for i in range(len(PROMPTS)):
        hits = np.flatnonzero(greedy[i] == eos)
        if hits.size:
            stop = hits[0]
            assert ro.finish_names()[i] == "eos"
            np.testing.assert_array_equal(tokens[i, : stop + 1], greedy[i, : stop + 1])
            assert np.all(tokens[i, stop + 1 :] == 1) and np.all(mask[i, stop + 1 :] == 0)
            assert mask[i, stop] == 1 and int(ro.lengths[i]) == stop + 1
        else:
            assert ro.finish_names()[i] == "length" and int(ro.lengths[i]) == N


def test_forced_interruption_inserts_the_text_at_the_drawn_budget(qwen2):
    text = (90, 91, 92)
    intr = Interruption(token_ids=text, think_min=2, think_max=6, answer_budget=3)
    ro = generate(
        qwen2,
        PROMPTS * 2,
        max_new_tokens=14,
        temperature=1.0,
        key=jax.random.key(5),
        interruption=intr,
    )
    tokens, mask = np.asarray(ro.completion_tokens), np.asarray(ro.completion_mask)
    budgets = set()
    for i in range(tokens.shape[0]):
        assert ro.finish_names()[i] == "interrupted"  # no EOS configured: every row hits its budget
        start = int(np.flatnonzero(mask[i] == 0)[0])  # first inserted token = the drawn budget
        budgets.add(start)
        assert 2 <= start <= 6
        assert tuple(tokens[i, start : start + 3]) == text
        assert np.all(mask[i, :start] == 1) and np.all(mask[i, start : start + 3] == 0)
        assert np.all(mask[i, start + 3 : start + 6] == 1)  # the answer budget
        assert np.all(mask[i, start + 6 :] == 0)
        assert int(ro.lengths[i]) == start + 6
        assert np.all(np.asarray(ro.behavior_logp)[i][mask[i] == 0] == 0)
    assert len(budgets) > 1  # budgets are drawn per row
    assert ro.interrupted_rate == 1.0
    with pytest.raises(ValueError, match="think_max"):
        generate(qwen2, PROMPTS, max_new_tokens=8, interruption=intr)


def test_a_row_that_closes_its_thinking_itself_is_never_interrupted(qwen2):
    """The budget is on thinking only. Greedy rows are deterministic, so the marker is taken
    from a reference decode: rows that sample it before the budget answer on untouched."""
    n, budget = N, 5
    reference = np.asarray(
        generate(qwen2, PROMPTS, max_new_tokens=n, temperature=0.0).completion_tokens
    )
    marker = tuple(int(t) for t in reference[0, 1:3])  # row 0 closes at its third token
    intr = Interruption(
        token_ids=(90, 91, 92),
        think_min=budget,
        think_max=budget,
        answer_budget=2,
        think_end_ids=marker,
    )
    ro = generate(qwen2, PROMPTS, max_new_tokens=n, temperature=0.0, interruption=intr)
    tokens, mask = np.asarray(ro.completion_tokens), np.asarray(ro.completion_mask)
    closers = 0
    for i, row in enumerate(reference):
        windows = [tuple(row[j : j + 2]) for j in range(budget - 1)]
        if marker in windows:  # closed within its thinking budget: left alone
            closers += 1
            np.testing.assert_array_equal(tokens[i], row)
            assert np.all(mask[i] == 1) and ro.finish_names()[i] == "length"
        else:
            np.testing.assert_array_equal(tokens[i, :budget], row[:budget])
            assert tuple(tokens[i, budget : budget + 3]) == (90, 91, 92)
            assert ro.finish_names()[i] == "interrupted" and int(ro.lengths[i]) == budget + 5
    assert 1 <= closers < len(PROMPTS)


def test_sample_token_truncation_by_hand():
    # probabilities 0.5, 0.3, 0.15, 0.05
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 2000))
    keys = jax.random.key(0)
    tok, logp = sample_token(logits, keys, Sampling(temperature=1.0, top_p=0.7))
    # top-p 0.7 keeps tokens 0 and 1 (mass above token 2 is 0.8 >= 0.7): 0.5 / 0.8, 0.3 / 0.8.
    assert set(np.asarray(tok).tolist()) == {0, 1}
    want = np.where(np.asarray(tok) == 0, math.log(0.625), math.log(0.375))
    np.testing.assert_allclose(logp, want, atol=1e-6)
    tok, logp = sample_token(logits, keys, Sampling(temperature=1.0, top_k=3))
    assert set(np.asarray(tok).tolist()) == {0, 1, 2}
    np.testing.assert_allclose(
        logp, np.log(np.array([0.5, 0.3, 0.15])[np.asarray(tok)] / 0.95), atol=1e-6
    )
    # temperature 0.5 squares and renormalises: 0.25 / (0.25 + 0.09 + 0.0225 + 0.0025)
    tok, logp = sample_token(logits[:1], keys, Sampling(temperature=0.5))
    p = np.array([0.25, 0.09, 0.0225, 0.0025]) / 0.365
    assert float(logp[0]) == pytest.approx(math.log(p[int(tok[0])]), abs=1e-6)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0.0)


def test_sharded_greedy_equals_single_device(qwen2):
    prompts = PROMPTS * 2  # B = 8 over the data axis
    mesh = sharding.make_mesh(MeshConfig(data=4, fsdp=1, tensor=2))
    single = generate(qwen2, prompts, max_new_tokens=8, temperature=0.0)
    sharded = generate(qwen2, prompts, max_new_tokens=8, temperature=0.0, mesh=mesh)
    np.testing.assert_array_equal(sharded.completion_tokens, single.completion_tokens)
    np.testing.assert_allclose(sharded.behavior_logp, single.behavior_logp, atol=1e-5)
    assert len(sharded.completion_tokens.sharding.device_set) == 8


def test_prompt_widths_are_few_and_every_prompt_fits():
    """Each width compiles prefill, decode and the train step once: prompts of 1..1000 tokens
    (the task's longest 1000) get 8 widths, not one per multiple of 8."""
    widths = [prompt_width(n, 1000) for n in range(1, 1001)]
    assert len(set(widths)) <= 8 and max(widths) == 1000  # capped by the longest, not 1024
    assert all(n <= w and w % 8 == 0 for n, w in enumerate(widths, start=1))
    tokens, mask = pad_prompts([[3] * 9, [4] * 17], 0, width=prompt_width(17))
    assert tokens.shape == (2, 32) and mask.sum(axis=1).tolist() == [9, 17]
    assert mask[:, -1].all() and tokens[1, -17:].tolist() == [4] * 17  # left-padded
    with pytest.raises(ValueError, match="does not fit"):
        pad_prompts([[3] * 9], 0, width=8)
