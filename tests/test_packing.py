"""Packed train steps: the layout, and a packed step's loss, gradients and metrics against the
padded step's for every loss kind and aggregation."""

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl_scale.config import LossConfig, ModelConfig
from jaxrl_scale.models.policy import Policy
from jaxrl_scale.rl.losses import loss_sums, loss_weights, metrics_from_sums, packed_loss_weights
from jaxrl_scale.rl.packing import bucket_rows, pack, unpack
from jaxrl_scale.rl.step import Batch, compile_train_step, init_train_state

CFG = ModelConfig(
    architecture="qwen3",
    vocab_size=16,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)
G, L, N = 4, 5, 9


def _batch(prompts=3, seed=0):
    """`prompts` x G completions of uneven length (one empty), left-padded prompts of
    different lengths, and a zero-variance group (its tokens do not count)."""
    rng = np.random.default_rng(seed)
    b = prompts * G
    prompt_len = rng.integers(2, L + 1, prompts)
    prompt_mask = np.zeros((b, L), bool)
    for g, n in enumerate(prompt_len):
        prompt_mask[g * G : (g + 1) * G, L - n :] = True
    prompt_tokens = np.where(prompt_mask, np.repeat(rng.integers(1, 16, (prompts, L)), G, 0), 0)
    lengths = rng.integers(1, N + 1, b)
    lengths[2] = 0  # a completion that emitted nothing
    lengths[5] = N  # one that ran to the budget
    mask = np.arange(N)[None, :] < lengths[:, None]
    tokens = np.where(mask, rng.integers(1, 16, (b, N)), 0)
    loss_mask = mask.astype(np.float32)
    loss_mask[3, 0] = 0.0  # an inserted token: context, not counted
    loss_mask[G : 2 * G] = 0.0  # group 1 had equal rewards (zero-variance filtered)
    behavior = np.where(mask, -rng.uniform(0.5, 3.0, (b, N)), 0.0).astype(np.float32)
    adv = rng.normal(size=b).astype(np.float32)
    adv[G : 2 * G] = 0.0
    return Batch(prompt_tokens, prompt_mask, tokens, mask, loss_mask, behavior, adv)


def _device(tree):
    return jax.tree.map(jnp.asarray, tree)


def test_bucketed_row_counts_are_few_and_never_more_than_a_quarter_over_the_need():
    shapes = {bucket_rows(r, 4) for r in range(1, 1025)}
    assert len(shapes) <= 4 * 8 + 2  # four per doubling of 1..256 units of 4 rows
    for r in range(1, 1025):
        got = bucket_rows(r, 4)
        units = -(-r // 4)
        assert got % 4 == 0 and got >= r and got / 4 <= 1.25 * units


def test_every_completion_token_is_packed_once_after_its_prompt_at_its_padded_position():
    batch = _batch()
    packed, stats = pack(batch, G, row_len=24)
    lengths = batch.mask.sum(1)
    np.testing.assert_array_equal(unpack(packed.tokens, packed, N), batch.tokens)
    np.testing.assert_array_equal(unpack(packed.loss_mask, packed, N), batch.loss_mask)
    prompt_len = batch.prompt_mask.sum(1)
    want_positions = np.where(batch.mask, prompt_len[:, None] + np.arange(N), 0)
    np.testing.assert_array_equal(unpack(packed.positions, packed, N), want_positions)
    # The token before completion token 0 is its prompt's last token; later ones follow.
    prev_tokens = np.take_along_axis(np.asarray(packed.tokens), np.asarray(packed.prev), 1)
    for b in np.flatnonzero(lengths):
        got = unpack(prev_tokens, packed, N)[b, : lengths[b]]
        prompt = batch.prompt_tokens[b][batch.prompt_mask[b]]
        want = np.concatenate([prompt[-1:], batch.tokens[b, :-1]])[: lengths[b]]
        np.testing.assert_array_equal(got, want)
    # Tokens: the real ones only, prompts once per segment; positions: the rows computed.
    assert stats.train_positions == packed.tokens.size
    wide, wide_stats = pack(batch, G, row_len=256)  # one row holds everything
    assert wide_stats.prompt_repeats == 0
    assert wide_stats.train_tokens == lengths.sum() + sum(prompt_len[g * G] for g in range(3))
    assert wide_stats.train_tokens == int(np.asarray(wide.valid).sum())


def test_a_group_too_long_for_one_row_repeats_its_prompt_and_too_short_a_row_is_an_error():
    batch = _batch()
    packed, stats = pack(batch, G, row_len=14)
    assert stats.prompt_repeats > 0
    np.testing.assert_array_equal(unpack(packed.tokens, packed, N), batch.tokens)
    with pytest.raises(ValueError, match="pack_length 8 is shorter than prompt"):
        pack(batch, G, row_len=8)


def test_sequences_of_their_own_score_alone_and_count_as_their_rows():
    """`pack`'s `alone` (an agent episode's other branches): each scores as the model does on
    it alone (positions from 0, nothing else visible), the completions beside it score as
    without it, and its sampled tokens weigh as its row's: one sample."""
    from jaxrl_scale.models.policy import token_logprobs
    from jaxrl_scale.rl.packing import Alone, packed_logprobs

    batch = _batch()
    rng = np.random.default_rng(3)

    def branch(seq, n):
        mask = (rng.uniform(size=n) < 0.6).astype(np.float32)
        logp = -rng.uniform(0.5, 2.0, n).astype(np.float32) * mask
        return Alone(seq, rng.integers(1, 16, n).astype(np.int32), mask, logp)

    alone = [branch(0, 7), branch(0, 5), branch(9, 11), branch(4, 30)]  # 30: longer than a row
    packed, stats = pack(batch, G, row_len=24, alone=alone)
    plain, _ = pack(batch, G, row_len=24)
    assert stats.alone == 3 and stats.alone_left == 1
    model = Policy(CFG, rngs=nnx.Rngs(params=0))
    got, want = (np.asarray(packed_logprobs(model, x, temperature=0.7)) for x in (packed, plain))
    sub, pos, seq = (np.asarray(x) for x in (packed.sub, packed.positions, packed.seq))
    starts = np.argwhere((sub == 1) & (pos == 0) & np.asarray(packed.valid))
    assert len(starts) == 3
    own = np.zeros(packed.shape, bool)
    for r, s0 in starts:
        a = next(
            a for a in alone if np.array_equal(packed.tokens[r, s0 : s0 + len(a.tokens)], a.tokens)
        )
        span = slice(s0, s0 + len(a.tokens))
        own[r, span] = True
        ref = token_logprobs(model, a.tokens[None], temperature=0.7)[0]
        np.testing.assert_allclose(got[r, span][1:], ref[1:], rtol=1e-5, atol=1e-6)
        assert (seq[r, span] == a.seq).all() and packed.loss_mask[r, s0] == 0.0
        np.testing.assert_array_equal(packed.loss_mask[r, span][1:], a.loss_mask[1:])
        assert (np.asarray(packed.adv)[r, span] == batch.adv[a.seq]).all()
    for b in range(batch.tokens.shape[0]):  # the completions: as packed without them
        np.testing.assert_allclose(got[(seq == b) & ~own], want[np.asarray(plain.seq) == b],
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
    np.testing.assert_array_equal(unpack(packed.tokens, packed, N), batch.tokens)
    # Where a completion and its own sequences fit in one row, they share it (a micro-step,
    # a slice of rows, holds all of its tokens); where not, they are placed apart, counted.
    wide, wide_stats = pack(batch, G, row_len=40, alone=alone[:3])
    assert wide_stats.alone == 3 and wide_stats.alone_split == 0
    for b in (0, 9):
        assert len({r for r, _ in np.argwhere(np.asarray(wide.seq) == b)}) == 1
    assert stats.alone_split == (alone[0].tokens.size + alone[1].tokens.size
                                 + batch.mask[0].sum() + batch.prompt_mask[0].sum() > 24) + (
        alone[2].tokens.size + batch.mask[9].sum() + batch.prompt_mask[9].sum() > 24)  # fmt: skip
    # "sample" aggregation: 1 / (the row's counted tokens, its branches' included x rows).
    w = np.asarray(packed_loss_weights(packed.loss_mask, packed.seq, packed.num_seqs, G,
                                       "cispo", "sample"))  # fmt: skip
    counted = batch.loss_mask.sum(1)
    counted[0] += alone[0].loss_mask[1:].sum() + alone[1].loss_mask[1:].sum()
    counted[9] += alone[2].loss_mask[1:].sum()
    rows = (counted > 0).sum()
    for b in (0, 9):
        np.testing.assert_allclose(w[(seq == b) & (np.asarray(packed.loss_mask) > 0)],
                                   1.0 / (counted[b] * rows), rtol=1e-6)  # fmt: skip


def _run(batch, loss, attention="xla", micro_batches=1, reference=False):
    cfg = dataclasses.replace(CFG, attention=attention, attention_block_size=8)
    graphdef, params = nnx.split(Policy(cfg, rngs=nnx.Rngs(params=0)))
    tx = optax.sgd(1.0)
    step = compile_train_step(
        graphdef, tx, group_size=G, loss_cfg=loss, temperature=0.7, micro_batches=micro_batches
    )
    before = jax.tree.map(np.array, params)
    state, metrics = step(init_train_state(params, tx, reference=reference), _device(batch))
    grads = jax.tree.map(lambda new, old: old - np.asarray(new), state.params, before)
    return metrics, grads


@pytest.mark.parametrize("kind", ["cispo", "dapo", "gspo", "grpo"])
@pytest.mark.parametrize("aggregation", ["prompt", "sample", "token"])
def test_packed_weights_and_loss_sums_equal_the_padded_ones(kind, aggregation):
    """The loss side alone (no model: the same per-token log-probs in both layouts)."""
    batch = _batch()
    packed, _ = pack(batch, G, row_len=24)
    rng = np.random.default_rng(1)
    logp = np.where(batch.mask, batch.behavior_logp + rng.normal(0, 0.2, batch.mask.shape), 0)
    logp_rs = np.zeros(packed.shape, np.float32)
    seq = np.asarray(packed.seq)
    for b in range(batch.tokens.shape[0]):
        logp_rs[seq == b] = logp[b, : int(batch.mask[b].sum())]
    hyper = {"kl_coef": 0.1} if kind == "grpo" else {}
    ref, ref_rs = logp - 0.05, np.where(seq < packed.num_seqs, logp_rs - 0.05, 0)
    want_w = loss_weights(batch.loss_mask, G, kind, aggregation)
    got_w = packed_loss_weights(packed.loss_mask, packed.seq, packed.num_seqs, G, kind, aggregation)
    np.testing.assert_allclose(unpack(got_w, packed, N), want_w, rtol=1e-6)
    for mismatch in ("none", "token", "sequence"):  # loss.mismatch_mask drops alike
        hyper.update(mismatch_mask=mismatch, mismatch_threshold=1.1)
        want = loss_sums(
            logp, batch.behavior_logp, batch.adv, batch.loss_mask, want_w, kind, ref, **hyper
        )
        got = loss_sums(
            logp_rs, packed.behavior_logp, packed.adv, packed.loss_mask, got_w, kind, ref_rs,
            seq_ids=packed.seq, num_seqs=packed.num_seqs, **hyper,
        )  # fmt: skip
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
        metrics = metrics_from_sums(want[1])
        assert (metrics["mismatch_masked"] > 0) == (mismatch != "none")
        for key, value in metrics.items():
            np.testing.assert_allclose(
                metrics_from_sums(got[1])[key], value, rtol=1e-5, err_msg=key
            )


@pytest.mark.parametrize(
    "kind,aggregation",
    [("cispo", "prompt"), ("dapo", "token"), ("gspo", "prompt"), ("grpo", "sample")],
)
def test_a_packed_step_equals_the_padded_step(kind, aggregation):
    """Loss, gradients and metrics of a packed step (several rows, a group split over two
    segments, two micro-batches) against the padded step's."""
    batch = _batch()
    packed, stats = pack(batch, G, row_len=24, row_multiple=2)
    assert stats.rows >= 2 and stats.prompt_repeats > 0
    hyper = {"kl_coef": 0.1} if kind == "grpo" else {}
    loss = LossConfig(kind=kind, aggregation=aggregation, **hyper)
    want, want_grads = _run(batch, loss, reference=kind == "grpo")
    got, got_grads = _run(packed, loss, micro_batches=2, reference=kind == "grpo")
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=2e-5, atol=1e-7, err_msg=key)
    for a, b in zip(jax.tree.leaves(want_grads), jax.tree.leaves(got_grads), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    assert float(want["grad_norm"]) > 1e-3  # the step did something


def test_blockwise_attention_honours_the_packed_mask_in_the_step():
    """Rows of 40 in blocks of 8: segments, and completions within them, start and end inside
    blocks and span block edges, and the last row ends in blocks of padding alone. The padded
    step is test_a_packed_step_equals_the_padded_step[cispo-prompt]'s (one compiled program)."""
    batch = _batch()
    packed, stats = pack(batch, G, row_len=40)
    assert stats.rows == 3 and stats.segments >= 6
    loss = LossConfig(kind="cispo", aggregation="prompt")
    want, want_grads = _run(batch, loss)
    got, got_grads = _run(packed, loss, attention="blockwise")
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=2e-5)
    for a, b in zip(jax.tree.leaves(want_grads), jax.tree.leaves(got_grads), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def test_a_packed_run_trains_like_the_padded_run_and_reports_its_padding(tmp_path):
    from jaxrl_scale.config import load_config
    from jaxrl_scale.train import train

    def run(name, *extra):
        small = ["train.prompts_per_step=8", "train.group_size=8", "train.steps=2"]
        small += ["task.num_eval=16", "pipeline.mode=sync", "forecast.every=0"]
        small += ["sampler.chunk_size=0"]  # see test_packed_batches_waiting_in_a_checkpoint_...
        return train(load_config("asset:demo.yaml", [*small, *extra]), tmp_path / name)

    padded = run("padded", "train.packing=false")
    packed = run("packed", "train.packing=true")
    auto = run("auto")  # the default
    # A budget below the padded step's micro-step (64 rows / 8 devices x 14 positions): auto
    # then always packs, one 24-token row per device per micro-step.
    short = ["train.packing=auto", "train.pack_length=24", "train.tokens_per_micro_batch=24"]
    budget = run("budget", *short)
    for a, b, c, d in zip(padded[1:], packed[1:], budget[1:], auto[1:], strict=True):
        assert abs(a["loss"]) > 1e-4 and a["grad_norm"] > 1e-4  # the shipped policy learns
        for key in ("loss", "grad_norm", "reward_mean", "mismatch", "kept_tokens"):
            for other in (b, c, d):
                np.testing.assert_allclose(other[key], a[key], rtol=1e-4, atol=1e-6, err_msg=key)
        # Padded: 8 prompts of 8 slots and 64 x 6 completion slots (these completions nearly
        # fill their 6-token budget: little padding to save; bench_packing has the heavy
        # tail). Packed: the real tokens, prompts again where a group spans rows.
        assert a["train_positions"] == 8 * 8 + 64 * 6 and a["train_packed"] == 0
        assert b["train_tokens"] >= a["train_tokens"] and c["train_tokens"] > a["train_tokens"]
        assert b["train_positions"] % (8 * 32) == 0  # rows of 2 x 14 -> 32, 8 devices
        assert c["train_positions"] >= 2 * 8 * 24  # two or more micro-steps of 8 rows
        assert b["train_packed"] == c["train_packed"] == 1
        # auto: packing these computes no fewer positions than padding, so it pads.
        assert b["train_positions"] >= a["train_positions"]
        assert (d["train_packed"], d["train_positions"]) == (0, a["train_positions"])


def test_auto_packs_a_batch_only_where_that_computes_fewer_positions():
    from jaxrl_scale.rl.packing import PackedBatch, PackGeometry

    auto = PackGeometry(row_len=40, row_multiple=1, rows_per_micro=None, auto=True)
    padded = {"train_tokens": 0, "train_positions": 3 * L + 3 * G * N, "train_packed": 0}
    short = _batch(seed=3)  # uneven lengths: 2 rows of 40 hold them
    got, stats = auto.layout(short, G, padded)
    assert isinstance(got, PackedBatch) and stats["train_positions"] == 80 < 123
    assert stats["train_packed"] == 1
    full = dataclasses.replace(short, mask=np.ones_like(short.mask))  # every one at the budget
    got, stats = auto.layout(full, G, padded)
    assert got is full and stats is padded
    always = dataclasses.replace(auto, auto=False)  # train.packing: true
    got, stats = always.layout(full, G, padded)
    # 12 x 9 completion tokens behind prompts of 2-5 need 3 rows at best; prompts repeat.
    assert isinstance(got, PackedBatch) and stats["train_positions"] >= 123


def test_packed_batches_waiting_in_a_checkpoint_come_back_packed(tmp_path):
    from jaxrl_scale.config import load_config
    from jaxrl_scale.rl.packing import PackedBatch
    from jaxrl_scale.train import setup, train, train_run

    overrides = ["train.prompts_per_step=8", "train.group_size=8", "train.steps=2"]
    overrides += ["task.num_eval=16", "forecast.every=0", "train.packing=true"]
    overrides += ["pipeline.mode=ppo_off_policy", "checkpoint.every=1"]
    # One decode chunk: these modes decode every chunk with the same weights, so chunks change
    # no token, but a second chunk compiles decode again (the first returns its state in other
    # shardings). As in test_a_packed_run_trains_like_the_padded_run_..., whose programs these
    # runs reuse.
    overrides += ["sampler.chunk_size=0"]
    cfg = load_config("asset:demo.yaml", overrides)
    train(cfg, tmp_path)
    # As if the run had died after step 1's checkpoint: policy 1's second batch is waiting.
    shutil.rmtree(tmp_path / "checkpoints" / "2")
    run = setup(cfg, tmp_path)
    (waiting,) = run.start.pending
    assert run.start.step == 1
    assert isinstance(waiting.batch, PackedBatch) and waiting.batch.num_seqs == 64
    assert int(np.asarray(waiting.batch.valid).sum()) == waiting.stats["train_tokens"]
    # Resumed with padded steps, the packed batch waiting still trains (its own step).
    padded = load_config("asset:demo.yaml", [*overrides, "train.packing=false"])
    rows = train_run(setup(padded, tmp_path))
    assert [r["step"] for r in rows] == [2] and rows[0]["train_packed"] == 1


def test_packing_settings_are_checked_and_named():
    from jaxrl_scale.config import ConfigError, load_config

    for bad, message in (
        (
            ["train.packing=false", "train.pack_length=64"],
            "train.pack_length: applies to packed steps only",
        ),
        (["train.packing=sometimes"], "train.packing: expected true or false or one of 'auto'"),
        (["train.packing=true", "train.tokens_per_micro_batch=-1"], "must be >= 0"),
        (
            ["train.packing=true", "train.pack_length=64", "train.tokens_per_micro_batch=32"],
            "must hold at least one packed row",
        ),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config("asset:demo.yaml", bad)


def _recipe_batch(cfg, prompt_len: int, seed: int = 0) -> Batch:
    """A batch at a recipe's shape on the host, completion lengths lognormal (sigma 1) with a
    mean of a quarter of the budget, cut at the budget (RL's heavy tail)."""
    rng = np.random.default_rng(seed)
    p, g, n = cfg.train.prompts_per_step, cfg.train.group_size, cfg.sampler.max_new_tokens
    b = p * g
    lengths = rng.lognormal(np.log(n / 4 / np.exp(0.5)), 1.0, b)
    lengths = np.clip(np.round(lengths), 1, n).astype(int)
    mask = np.arange(n)[None, :] < lengths[:, None]
    prompt_mask = np.ones((b, prompt_len), bool)
    ones = np.ones((b, n), np.float32)
    return Batch(prompt_mask.astype(np.int32), prompt_mask, mask.astype(np.int32), mask,
                 mask * ones, -ones, np.ones(b, np.float32))  # fmt: skip


def test_packing_at_the_8b_recipe_shape_computes_a_fraction_of_the_padded_positions():
    """Qwen3-8B, 48 x 16 completions of up to 16,384 tokens on 8 FSDP shards, 48 padded
    micro-steps of 2 rows each per shard: the packed step's micro-steps hold what a padded
    one does per shard (one row of 34,816 here) and a batch takes as many as its rows fill,
    so lognormal lengths (mean 4k) compute about a third of the padded positions. (Rounded to
    the padded micro-steps' 384 rows, the packed step computed as many as the padded one.)"""
    from jaxrl_scale.config import load_config
    from jaxrl_scale.rl.packing import PackGeometry, padded_layout

    cfg = load_config("configs/scalerl_qwen3-8b_math.yaml")
    geometry = PackGeometry.of(cfg, 1024, 8)
    assert (geometry.row_len, geometry.rows_per_micro) == (34_816, 8)
    batch = _recipe_batch(cfg, 1024)
    ro = dataclasses.make_dataclass("Ro", ["prompt_mask", "lengths", "completion_tokens"])(
        batch.prompt_mask, batch.mask.sum(1), batch.tokens
    )
    padded = padded_layout(ro, cfg.train.group_size)
    assert padded["train_positions"] == 48 * 1024 + 768 * 16_384
    got, stats = geometry.layout(batch, cfg.train.group_size, padded)
    assert stats["train_packed"] == 1 and got.shape[0] % 8 == 0
    assert stats["train_positions"] < 0.4 * padded["train_positions"], stats
    # Every row holds real tokens but the last few of the bucket.
    assert stats["train_tokens"] > 0.85 * stats["train_positions"]


def test_packed_rows_cost_what_they_hold_at_the_demos_shapes_on_one_device():
    """The demo's shapes on one device, sync: 32 x 16 completions of 2-5 tokens (about 3 on
    average) under sampler.max_new_tokens=192. The token budget of a micro-step is the padded
    step's (512 rows of 200 positions: 102,400), but a batch that fills 6 rows computes 8
    (the smallest rung), not a budget's worth: efficiency >= 0.6. Before, the rows were
    rounded up to a whole micro-step: 102,400 positions for ~1,900 tokens, the padded
    step's count. A batch past the budget runs as micro-steps of equal rows, each within
    it."""
    from jaxrl_scale.config import load_config
    from jaxrl_scale.rl.packing import PackGeometry, micro_steps, padded_layout, step_rows

    cfg = load_config("asset:demo.yaml", [
        "train.prompts_per_step=32", "sampler.max_new_tokens=192", "mesh.data=1",
        "pipeline.mode=sync", "train.packing=true",
    ])  # fmt: skip
    geometry = PackGeometry.of(cfg, 6, 1)
    assert geometry.rows_per_micro * geometry.row_len <= 102_400
    p, g, width = 32, 16, 8
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 6, p * g)
    mask = np.arange(192)[None, :] < lengths[:, None]
    prompt_mask = np.ones((p * g, width), bool)
    ones = np.ones((p * g, 192), np.float32)
    batch = Batch(prompt_mask.astype(np.int32), prompt_mask, mask.astype(np.int32), mask,
                  mask * ones, -ones, np.ones(p * g, np.float32))  # fmt: skip
    ro = dataclasses.make_dataclass("Ro", ["prompt_mask", "lengths", "completion_tokens"])(
        prompt_mask, lengths, batch.tokens
    )
    padded = padded_layout(ro, g)
    assert padded["train_positions"] == 32 * 8 + 512 * 192 == 98_560
    got, stats = geometry.layout(batch, g, padded)
    assert stats["train_packed"] == 1 and got.shape[0] * geometry.row_len == stats[
        "train_positions"]  # fmt: skip
    assert stats["train_tokens"] >= lengths.sum() + 32 * 8  # (a prompt again in a 2nd row)
    assert stats["train_tokens"] / stats["train_positions"] >= 0.6, stats
    assert stats["train_positions"] < 0.05 * padded["train_positions"], stats
    # Past the budget: as few micro-steps as hold the rows, equal ones, each within it.
    per = geometry.rows_per_micro
    for rows in (1, per - 1, per, per + 1, 3 * per + 7):
        total = step_rows(rows, 1, per)
        m = micro_steps(total, per)
        assert total >= rows and total % m == 0 and total // m <= per
        assert m == -(-rows // per) and total <= max(2 * rows, per // 32)


def test_a_packed_run_compiles_few_train_step_shapes_at_the_demos_shapes_on_one_device():
    """Each packed row count is a compile of the train step. At the demo's shapes on one
    device (a budget of 256 rows of 400 per micro-step) any batch, 1 to 512 rows (one
    completion per row at most), runs in one of 7 shapes: a micro-step of 8, 16, ..., 256
    rows (MICRO_RUNGS = 6 halvings of the budget), or two of 256. (The 1.25x ladder allowed
    28 shapes of one micro-step here.) Each costs at most twice the rows it holds, or 8."""
    from jaxrl_scale.config import load_config
    from jaxrl_scale.rl.packing import MICRO_RUNGS, PackGeometry, micro_steps, step_rows

    cfg = load_config("asset:demo.yaml", [
        "train.prompts_per_step=32", "sampler.max_new_tokens=192", "mesh.data=1",
        "pipeline.mode=sync", "train.packing=true",
    ])  # fmt: skip
    geometry = PackGeometry.of(cfg, 6, 1)
    per, multiple = geometry.rows_per_micro, geometry.row_multiple
    assert (per, multiple, geometry.row_len) == (256, 1, 400)
    shapes = {}
    for rows in range(1, 32 * 16 + 1):
        total = step_rows(rows, multiple, per)
        shapes[total, micro_steps(total, per)] = rows
        assert rows <= total <= max(2 * rows, per // 2 ** (MICRO_RUNGS - 1))
    assert sorted(shapes) == [(8, 1), (16, 1), (32, 1), (64, 1), (128, 1), (256, 1), (512, 2)]
    assert len(shapes) <= MICRO_RUNGS + 1


def test_auto_counts_the_fused_kernel_a_packed_step_gives_up():
    """With the padded step on a fused kernel (its attention 2x as fast here), fewer positions
    alone do not make packing cheaper: the same batch that auto packs beside a blockwise
    padded step, it pads beside a fused one (costs by hand)."""
    from jaxrl_scale.rl.packing import MIN_SAVING, PackGeometry

    batch = _batch(seed=3)  # 2 rows of 40 hold it: 80 positions against 123 padded
    padded = {"train_tokens": 0, "train_positions": 3 * L + 3 * G * N, "train_packed": 0}
    # A query-key pair costs a twentieth of a position's matmuls.
    blockwise = PackGeometry(40, 1, None, auto=True, matmul_flops=1.0, attention_flops=0.05)
    padded_pairs = 3 * 15 + 3 * G * (9 * 5 + 45)  # prompts' triangles; completions' keys
    packed_pairs = 2 * 40 * 41 / 2  # each row's whole causal triangle
    assert blockwise.cost(80, packed_pairs, padded=False) == 80 + 82
    assert blockwise.cost(123, padded_pairs, padded=True) == 123 + 56.25
    got, stats = blockwise.layout(batch, G, padded)  # 162 < 0.95 x 179.25
    assert stats["train_packed"] == 1 and stats["train_positions"] == 80
    fused = dataclasses.replace(blockwise, padded_speedup=2.0)
    assert fused.cost(123, padded_pairs, padded=True) == 123 + 28.125
    assert (1 - MIN_SAVING) * (123 + 28.125) < 162
    got, stats = fused.layout(batch, G, padded)
    assert got is batch and stats is padded
