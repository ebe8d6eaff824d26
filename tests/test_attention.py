"""Blockwise attention, the cuDNN path's slot gathering, splash, remat and scanned layers: each
against the stored-scores reference (values and gradients), and memory and collectives read from
the compiled program."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_scale.config import MeshConfig
from jaxrl_scale.models import attention
from jaxrl_scale.models.policy import completion_logprobs, init_policy, token_logprobs
from jaxrl_scale.parallel import sharding


def _random_case(seed, b=3, t=37, s=53, h=4, k=2, e=8, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, t, h, e)), dtype)
    kk = jnp.asarray(rng.normal(size=(b, k, s, e)), dtype)
    v = jnp.asarray(rng.normal(size=(b, k, s, e)), dtype)
    valid = jnp.asarray(rng.random((b, s)) > 0.25)
    # Queries at sorted random slots: offsets, repeats and queries that see nothing.
    qslot = jnp.asarray(np.sort(rng.integers(-2, s, (b, t)), axis=1), jnp.int32)
    return q, kk, v, valid, qslot


def _value_and_grads(implementation, block, case, cotangent):
    q, k, v, valid, qslot = case

    def f(q, k, v):
        out = attention.attend(
            q, k, v, valid, qslot, scale=0.3, implementation=implementation, block_size=block
        )
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


@functools.cache
def _stored_scores_case():
    """(case, the queries that see a key, cotangent, stored-scores values and gradients): one
    reference for every block size."""
    case = _random_case(0)
    seen = np.asarray(attention.slot_mask(case[3], case[4]).any(-1))  # [B, T]
    cotangent = jax.random.normal(jax.random.key(1), case[0].shape) * seen[:, :, None, None]
    return case, seen, cotangent, *_value_and_grads("xla", 512, case, cotangent)


@pytest.mark.parametrize("block", [4, 16, 64])
def test_blockwise_equals_stored_scores_in_values_and_gradients(block):
    case, seen, cotangent, want, want_g = _stored_scores_case()
    assert not seen.all() and seen.any()  # the case has queries that see nothing
    got, got_g = _value_and_grads("blockwise", block, case, cotangent)
    np.testing.assert_allclose(got[seen], want[seen], atol=2e-6)
    np.testing.assert_array_equal(np.asarray(got)[~seen], 0.0)  # zeros, not NaN
    for a, b in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_blockwise_in_bfloat16_stays_close_to_float32():
    case = _random_case(2, dtype=jnp.bfloat16)
    seen = np.asarray(attention.slot_mask(case[3], case[4]).any(-1))
    cotangent = jnp.ones(case[0].shape) * seen[:, :, None, None]
    ref, ref_g = _value_and_grads("xla", 512, tuple(_f32(x) for x in case), cotangent)
    got, got_g = _value_and_grads("blockwise", 16, case, cotangent)
    assert got.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in got_g)
    np.testing.assert_allclose(_f32(got)[seen], ref[seen], atol=3e-2)
    for a, b in zip(got_g, ref_g, strict=True):
        np.testing.assert_allclose(_f32(a), b, atol=0.1, rtol=0.05)


def _f32(x):
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


def test_blockwise_stores_nothing_quadratic():
    """Forward + backward temp memory from XLA's compiled-memory analysis: from T = 1k to 4k the
    stored-scores version grows ~16x (T^2), the blockwise one about linearly."""
    h, k, e = 8, 2, 64

    def temp(implementation, t):
        shapes = (
            jax.ShapeDtypeStruct((1, t, h, e), jnp.float32),
            jax.ShapeDtypeStruct((1, k, t, e), jnp.float32),
            jax.ShapeDtypeStruct((1, k, t, e), jnp.float32),
        )

        def loss(q, kk, v):
            valid = jnp.ones((1, t), bool)
            qslot = jnp.arange(t, dtype=jnp.int32)[None]
            out = attention.attend(
                q, kk, v, valid, qslot, scale=0.1, implementation=implementation, block_size=256
            )
            return jnp.sum(out)

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return grad.lower(*shapes).compile().memory_analysis().temp_size_in_bytes

    temps = {(i, t): temp(i, t) for i in ("xla", "blockwise") for t in (1024, 4096)}
    xla = temps["xla", 4096] / temps["xla", 1024]
    blockwise = temps["blockwise", 4096] / temps["blockwise", 1024]
    assert xla > 10, xla
    assert blockwise < 6, blockwise
    assert temps["blockwise", 4096] < temps["xla", 4096] / 8


def _collectives_in_loops(hlo: str) -> tuple[int, list[str]]:
    """(number of while loops, collective instructions inside any while loop's body or
    condition or any computation those call) of a compiled HLO module's text."""
    computations, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?%([\w.\-]+) \(", line)
        if head:
            name = head.group(1)
            computations[name] = []
        elif name is not None:
            computations[name].append(line)
    callee = r"\b(?:body|condition|calls|to_apply|branch_computations|true_computation|" \
        r"false_computation)=(\{[^}]*\}|%[\w.\-]+)"  # fmt: skip

    def called(lines):
        refs = (r for line in lines for r in re.findall(callee, line))
        return {n for r in refs for n in re.findall(r"%([\w.\-]+)", r)}

    loops = [ln for lines in computations.values() for ln in lines if re.search(r" while\(", ln)]
    todo = {n for ln in loops for n in re.findall(r"\b(?:body|condition)=%([\w.\-]+)", ln)}
    inside = set()
    while todo:
        name = todo.pop()
        inside.add(name)
        todo |= called(computations[name]) - inside
    op = r" (all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter)(-start)?\("
    found = [ln.strip() for n in inside for ln in computations[n] if re.search(op, ln)]
    return len(loops), found


def test_blockwise_under_split_rows_has_no_collective_inside_its_loops():
    """Rows split over 8 devices (the train step's batch axes, traced under its mesh): the
    compiled forward + backward decides which block pairs to skip before its loops, so no
    loop body holds a collective, and its values and gradients are the stored-scores ones."""
    b, t, block = 8, 64, 16
    q, kk, v, valid, _ = _random_case(7, b=b, t=t, s=t)
    valid = valid | (jnp.arange(t) >= 40)[None]  # holes, but every row's tail is real
    qslot = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=4, tensor=1))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    args = jax.device_put((q, kk, v, valid, qslot), rows)
    cotangent = jax.random.normal(jax.random.key(1), q.shape) * valid[:, :, None, None]

    def grads(implementation):
        def loss(q, k, v, valid, qslot):
            out = attention.attend(
                q, k, v, valid, qslot, scale=0.3, implementation=implementation, block_size=block
            )
            return jnp.sum(out * cotangent)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        step = grads("blockwise")
        loops, collectives = _collectives_in_loops(step.lower(*args).compile().as_text())
        got, got_g = step(*args)
    assert loops >= 6  # forward, dq and dk/dv: a loop over blocks inside a loop over blocks
    assert not collectives, collectives
    want, want_g = grads("xla")(q, kk, v, valid, qslot)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b_ in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(a, b_, atol=1e-5)


def test_cudnn_gathering_is_the_slot_mask_on_any_rows():
    """The cuDNN path gathers each row's valid slots to the front and asks for causal attention
    with sequence lengths; run through jax's XLA implementation of the same call, it equals
    the slot mask at every valid slot, in values and gradients, on rows with left padding,
    right padding and holes (a packed row or a prompt followed by a gap)."""
    rng = np.random.default_rng(3)
    b, t, h, k, e = 4, 12, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(b, t, h, e)), jnp.float32)
    kk = jnp.asarray(rng.normal(size=(b, k, t, e)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, k, t, e)), jnp.float32)
    valid = np.zeros((b, t), bool)
    valid[0, :] = True
    valid[1, 3:9] = True  # left and right padding
    valid[2, [1, 2, 5, 6, 7, 10]] = True  # holes
    valid[3, [0, 1, 2, 3, 8, 9, 10, 11]] = True  # one hole in the middle
    qslot = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cotangent = jnp.asarray(rng.normal(size=q.shape) * valid[:, :, None, None], jnp.float32)

    def value_and_grads(run):
        f = lambda q, k, v: jnp.sum(run(q, k, v) * cotangent)  # noqa: E731
        return jax.jit(run)(q, kk, v), jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, kk, v)

    want, want_g = value_and_grads(
        lambda q, k, v: attention.attend(q, k, v, jnp.asarray(valid), qslot, scale=0.3)
    )
    got, got_g = value_and_grads(
        lambda q, k, v: attention.cudnn_self_attention(
            q, k, v, jnp.asarray(valid), scale=0.3, implementation=None
        )
    )
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=1e-5)
    for a, b_ in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(a, b_, atol=1e-5)


@pytest.mark.parametrize("holes", [True, False])
def test_splash_equals_stored_scores_at_a_static_offset_in_values_and_gradients(holes):
    """The splash kernel (in the Pallas interpreter here) on queries at slots offset + t, with
    or without holes in the valid slots, T and S not whole blocks: every query whose own slot
    is valid matches the slot mask, and so do the gradients (padding queries' cotangents are
    zero, as the model's are; without holes the blocks' padded queries see no key at all)."""
    b, t, s, offset = 2, 37, 53, 16
    q, kk, v, valid, _ = _random_case(4, b=b, t=t, s=s)
    valid = valid.at[:, offset].set(True) if holes else jnp.ones_like(valid)
    qslot = jnp.broadcast_to(offset + jnp.arange(t, dtype=jnp.int32), (b, t))
    real = np.asarray(valid[:, offset : offset + t])
    assert real.any() and (real.all() != holes)
    cotangent = jax.random.normal(jax.random.key(1), q.shape) * real[:, :, None, None]

    def value_and_grads(implementation, block):
        def f(q, k, v):
            out = attention.attend(
                q, k, v, valid, qslot, scale=0.3, implementation=implementation,
                block_size=block, query_offset=offset,
            )  # fmt: skip
            return jnp.sum(out.astype(jnp.float32) * cotangent), out

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, kk, v)

    (_, want), want_g = value_and_grads("xla", 512)
    (_, got), got_g = value_and_grads("splash", 128)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5)
    for a, b_ in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(a, b_, atol=1e-4)


def test_splash_splits_rows_and_heads_over_the_mesh():
    """Under a mesh (the train step's), splash runs per device in a shard_map: same numbers as
    one device, and the compiled program never gathers the rows."""
    b, t, h, k, e = 4, 40, 4, 2, 8
    q, kk, v, valid, _ = _random_case(5, b=b, t=t, s=t, h=h, k=k, e=e)
    valid = valid | (jnp.arange(t) >= 8)[None]  # left padding only: every query's slot real
    qslot = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    run = functools.partial(
        attention.attend, scale=0.3, implementation="splash", block_size=128, query_offset=0
    )
    want = run(q, kk, v, valid, qslot)
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    P = jax.sharding.PartitionSpec
    put = lambda x, *spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, P(*spec)))  # noqa: E731
    args = (
        put(q, ("data", "fsdp"), None, "tensor"), put(kk, ("data", "fsdp"), "tensor"),
        put(v, ("data", "fsdp"), "tensor"), put(valid, ("data", "fsdp")),
        put(qslot, ("data", "fsdp")),
    )  # fmt: skip
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        step = jax.jit(run)
        text = step.lower(*args).compile().as_text()
        got = step(*args)
    assert "all-gather" not in text
    real = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-5)


def test_auto_picks_stored_scores_for_one_block_and_decode_and_blockwise_beyond():
    pick = lambda **kw: attention.resolve(  # noqa: E731
        "auto", block_size=512, dtype=jnp.bfloat16, query_offset=0, **kw
    )
    assert pick(queries=256, keys=256) == "xla"
    assert pick(queries=1, keys=32_768) == "xla"
    expected_long = {"gpu": "cudnn", "tpu": "splash"}.get(jax.default_backend(), "blockwise")
    assert pick(queries=16_384, keys=16_384) == expected_long
    # cuDNN cannot serve float32 or a cache's offset queries; splash cannot serve per-row
    # offsets: blockwise does.
    for kw in ({"dtype": jnp.float32}, {"query_offset": 512}, {"query_offset": None}):
        args = {"dtype": jnp.bfloat16, "query_offset": 0, **kw}
        got = attention.resolve("cudnn", queries=64, keys=64, block_size=512, **args)
        assert got == "blockwise"
    args = {"queries": 64, "keys": 64, "block_size": 512, "dtype": jnp.bfloat16}
    assert attention.resolve("splash", query_offset=None, **args) == "blockwise"
    assert attention.resolve("splash", query_offset=16, **args) == "splash"


# --------------------------------------------------------------------------- in the model


def _grouped_rows(vocab, prompt=7, new=9):
    """2 prompts (the second left-padded) x 2 completions each, of unequal lengths."""
    rng = np.random.default_rng(5)
    prompts = rng.integers(1, vocab, (2, prompt))
    prompt_mask = np.ones((2, prompt), bool)
    prompt_mask[1, :3] = False
    prompts[~prompt_mask] = 0
    completions = rng.integers(1, vocab, (4, new))
    mask = np.arange(new)[None] < np.array([[new], [4], [1], [new - 2]])
    completions[~mask] = 0
    return prompts, prompt_mask, completions, mask


VARIANTS = {  # configurations that must compute the stored-scores reference's numbers
    "blockwise": {"attention": "blockwise", "attention_block_size": 4},
    "remat_full": {"remat": "full"},
    "remat_dots_blockwise": {"remat": "dots", "attention": "blockwise", "attention_block_size": 4},
    "scan": {"scan_layers": True},
    "scan_remat_blockwise": {
        "scan_layers": True,
        "remat": "full",
        "attention": "blockwise",
        "attention_block_size": 4,
    },
    # The Pallas splash kernel (interpreted on CPU): self-attention, the prompt's prefill and
    # the completions appended at a static offset.
    "splash": {"attention": "splash", "attention_block_size": 128},
    "scan_remat_splash": {"scan_layers": True, "remat": "full", "attention": "splash"},
}


def _variant_rows(vocab):
    """The grouped rows as full rows, their mask, and which of their tokens are scored."""
    prompts, prompt_mask, completions, mask = _grouped_rows(vocab)
    rows = np.concatenate([np.repeat(prompts, 2, axis=0), completions], axis=1)
    row_mask = np.concatenate([np.repeat(prompt_mask, 2, axis=0), mask], axis=1)
    # A row's first real token has no context (it is scored from a padding slot): not compared.
    scored = row_mask & np.pad(row_mask[:, :-1], ((0, 0), (1, 0)))
    return rows, row_mask, scored


@functools.cache
def _logprobs_and_gradients(cfg):
    """(token_logprobs of the rows, completion_logprobs of the groups, parameter gradients of
    their weighted sum) of the policy `cfg` (seed 6): computed once per config, so every
    variant compares with one run of the reference."""
    prompts, prompt_mask, completions, mask = _grouped_rows(cfg.vocab_size)
    rows, row_mask, scored = _variant_rows(cfg.vocab_size)
    w_rows = jax.random.normal(jax.random.key(1), rows.shape) * scored
    w_completions = jax.random.normal(jax.random.key(2), completions.shape) * mask

    def loss(m):
        full = token_logprobs(m, jnp.asarray(rows), mask_bt=jnp.asarray(row_mask), chunk_size=5)
        shared = completion_logprobs(m, prompts, prompt_mask, completions, mask, temperature=0.9)
        return jnp.sum(full * w_rows) + jnp.sum(shared * w_completions), (full, shared)

    grad = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
    (_, (full, shared)), grads = grad(init_policy(cfg, seed=6))
    return np.asarray(full), np.asarray(shared), [np.asarray(g) for g in jax.tree.leaves(grads)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_model_variants_match_the_reference_in_logprobs_and_gradients(tiny_model_config, variant):
    """token_logprobs on left-padded rows and completion_logprobs (the group-shared prompt, per-row
    positions): values and parameter gradients equal the unscanned, stored-scores model's."""
    base = dataclasses.replace(tiny_model_config, attention="xla", qk_norm=True)
    cfg = dataclasses.replace(base, **VARIANTS[variant])
    mask = _grouped_rows(cfg.vocab_size)[3]
    scored = _variant_rows(cfg.vocab_size)[2]
    want_full, want_shared, want_g = _logprobs_and_gradients(base)
    got_full, got_shared, got_g = _logprobs_and_gradients(cfg)
    np.testing.assert_allclose(
        np.where(scored, got_full, 0), np.where(scored, want_full, 0), atol=2e-5
    )
    np.testing.assert_allclose(
        np.where(mask, got_shared, 0), np.where(mask, want_shared, 0), atol=2e-5
    )
    for a, b in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(a, b, atol=5e-5)


def test_scanned_layers_compile_one_layer():
    """With scan_layers the compiled train forward holds one layer's program whatever the depth:
    the lowered text barely grows from 2 to 8 layers, where the loop's grows ~4x."""
    from jaxrl_scale.config import ModelConfig

    def text_size(layers, scan):
        cfg = ModelConfig(
            num_layers=layers, scan_layers=scan, attention="blockwise", attention_block_size=8
        )
        model = init_policy(cfg)
        tokens = jnp.zeros((2, 32), jnp.int32)
        f = nnx.jit(nnx.grad(lambda m: jnp.sum(token_logprobs(m, tokens))))
        return len(f.lower(model).as_text())

    assert text_size(8, True) < 1.3 * text_size(2, True)
    assert text_size(8, False) > 2.5 * text_size(2, False)


def test_long_sequence_gradient_on_cpu(tiny_model_config):
    """A 4k-token row through a small model (two query heads on one key/value head, so the
    stored scores, [2, T, T] per layer, are cheap to run): blockwise + remat + scanned layers
    give the stored-scores model's log-probs and gradients."""
    t = 4096
    base = dataclasses.replace(
        tiny_model_config, attention="xla", vocab_size=128, num_heads=2, num_kv_heads=1
    )
    cfg = dataclasses.replace(base, attention="blockwise", remat="full", scan_layers=True)
    tokens = jax.random.randint(jax.random.key(0), (1, t), 1, base.vocab_size)
    mask = jnp.arange(t)[None] >= 100  # left padding
    # Scored tokens: real ones with a real token before them.
    weights = jax.random.normal(jax.random.key(1), (1, t)) * (jnp.arange(t)[None] > 100)

    def grad(cfg):
        m = init_policy(cfg, seed=8)
        f = lambda m: jnp.sum(token_logprobs(m, tokens, mask_bt=mask) * weights)  # noqa: E731
        return nnx.jit(nnx.value_and_grad(f))(m)

    (want, want_g), (got, got_g) = grad(base), grad(cfg)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-3)
