import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_scale.config import MeshConfig
from jaxrl_scale.parallel import sharding
from jaxrl_scale.rl.losses import (
    aggregate,
    combine_sums,
    loss_sums,
    loss_weights,
    metrics_from_sums,
    policy_loss,
)

LN2, LN8 = math.log(2.0), math.log(8.0)

# Two prompts x two samples, T = 3. Ratios rho = exp(logp - behaviour):
#   row 0 (prompt 0): 2 tokens, rho = [1, 2], A = +1
#   row 1 (prompt 0): 3 tokens, rho = [1, 1, 1], A = -1
#   row 2 (prompt 1): 1 token,  rho = [8], A = +2
#   row 3 (prompt 1): masked out entirely (a dropped row), A = 3
LOGP = np.array(
    [[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5], [-1.0, -9.0, -9.0], [-3.0, -3.0, -3.0]], np.float32
)
BEHAVIOUR = np.array(
    [[-1.0, -2.0 - LN2, -9.0], [-0.5, -0.5, -0.5], [-1.0 - LN8, -9.0, -9.0], [-1.0, -1.0, -1.0]],
    np.float32,
)
ADV = np.array([1.0, -1.0, 2.0, 3.0], np.float32)
MASK = np.array([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]], np.float32)


def _loss(kind, aggregation="token", logp=LOGP, **kw):
    return policy_loss(
        jnp.asarray(logp),
        BEHAVIOUR,
        ADV,
        MASK,
        group_size=2,
        kind=kind,
        aggregation=aggregation,
        **kw,
    )


def _grad(kind, aggregation="token", **kw):
    return np.asarray(jax.grad(lambda lp: _loss(kind, aggregation, logp=lp, **kw)[0])(LOGP))


# --------------------------------------------------------------------------- values by hand


def test_cispo_all_aggregations_by_hand():
    # J = min(rho, 5) * A * logp:
    #   row 0: 1 * 1 * -1 = -1,  2 * 1 * -2 = -4
    #   row 1: 1 * -1 * -0.5 = 0.5 (three times)
    #   row 2: min(8, 5) * 2 * -1 = -10
    # token:  (-1 - 4 + 1.5 - 10) / 6 = -2.25
    # sample: (-5 / 2 + 1.5 / 3 - 10 / 1) / 3 = (-2.5 + 0.5 - 10) / 3 = -4; row 3 has no tokens
    # prompt: prompt 0 (-5 + 1.5) / 5 = -0.7, prompt 1 -10 / 1 = -10 -> mean -5.35
    for aggregation, want in (("token", 2.25), ("sample", 4.0), ("prompt", 5.35)):
        loss, _ = _loss("cispo", aggregation)
        assert float(loss) == pytest.approx(want, abs=1e-5), aggregation


def test_dapo_by_hand():
    # J = min(rho * A, clip(rho, 0.8, 1.28) * A):
    #   row 0: min(1, 1) = 1; min(2, 1.28) = 1.28        row 1: -1 three times
    #   row 2: min(16, 2.56) = 2.56
    # token: (1 + 1.28 - 3 + 2.56) / 6 = 1.84 / 6
    loss, m = _loss("dapo")
    assert float(loss) == pytest.approx(-1.84 / 6, abs=1e-6)
    assert float(m["clip_fraction"]) == pytest.approx(2 / 6)  # row 0 token 1, row 2 token 0
    assert float(m["kept_tokens"]) == 6
    assert float(m["rho_max"]) == pytest.approx(8.0, rel=1e-5)
    # mean rho (1 + 2 + 1 + 1 + 1 + 8) / 6 = 14 / 6; mean |log rho| (ln 2 + ln 8) / 6
    assert float(m["rho_mean"]) == pytest.approx(14 / 6, rel=1e-5)
    assert float(m["mismatch"]) == pytest.approx((LN2 + LN8) / 6, rel=1e-5)
    # k3: rho - 1 - ln rho = (2 - 1 - ln 2) + (8 - 1 - ln 8) over 6 tokens
    assert float(m["approx_kl"]) == pytest.approx((1 - LN2 + 7 - LN8) / 6, rel=1e-5)


def test_gspo_sequence_ratio_by_hand():
    # Row 0: mean log rho = (0 + ln 2) / 2 -> s = sqrt(2) = 1.41421; A = 1 -> min(1.41421, 1.0004)
    # = 1.0004 on both tokens. Row 1: s = 1 -> -1 on 3 tokens. Row 2: s = 8, A = 2 -> 2.0008.
    # sample: (1.0004 - 1 + 2.0008) / 3 = 2.0012 / 3
    loss, m = _loss("gspo", "sample")
    assert float(loss) == pytest.approx(-2.0012 / 3, abs=1e-6)
    assert float(m["clip_fraction"]) == pytest.approx(3 / 6)  # rows 0 and 2 clipped


def test_gspo_prompt_aggregation_weighs_a_prompts_sequences_equally_by_hand():
    # Sequence objectives (as above): row 0 1.0004, row 1 -1, row 2 2.0008; row 3 has no tokens.
    # GSPO's 1/G per group: prompt 0 (1.0004 - 1) / 2 = 0.0002, prompt 1 2.0008 (its only row
    # with tokens) -> mean 1.0005. Token weighting would give (2 * 1.0004 - 3) / 5 for prompt 0.
    loss, _ = _loss("gspo", "prompt")
    assert float(loss) == pytest.approx(-1.0005, abs=1e-6)


def test_mismatch_telemetry_by_hand():
    # Counted ratios [1, 2, 1, 1, 1, 8]: |log rho| max ln 8; ESS (14)^2 / (6 * 72) = 196 / 432;
    # per-sequence geometric means sqrt(2), 1, 8 (row 3 has no tokens): range [1, 8].
    _, m = _loss("cispo")
    assert float(m["mismatch_max"]) == pytest.approx(LN8, rel=1e-6)
    assert float(m["ess_fraction"]) == pytest.approx(196 / 432, rel=1e-6)
    assert float(m["seq_ratio_min"]) == pytest.approx(1.0, rel=1e-6)
    assert float(m["seq_ratio_max"]) == pytest.approx(8.0, rel=1e-5)
    _, on_policy = policy_loss(LOGP, LOGP, ADV, MASK, 2)
    assert float(on_policy["ess_fraction"]) == pytest.approx(1.0)
    assert float(on_policy["mismatch_max"]) == 0.0


@pytest.mark.parametrize("kind", ["cispo", "dapo", "gspo", "grpo"])
@pytest.mark.parametrize("aggregation", ["prompt", "sample", "token"])
def test_slices_with_whole_batch_weights_add_up_to_the_whole_batch(kind, aggregation):
    """Micro-batching: zero-variance groups leave the slices uneven (slice 0 keeps one prompt,
    slice 1 three); with the whole batch's weights their losses, gradients and metrics
    combine into exactly the whole batch's."""
    rng = np.random.default_rng(1)
    g, b, t = 2, 16, 5
    logp = rng.normal(-2, 0.5, (b, t)).astype(np.float32)
    behaviour = (logp + rng.normal(0, 0.3, (b, t))).astype(np.float32)
    ref = (logp + rng.normal(0, 0.2, (b, t))).astype(np.float32)
    adv = rng.normal(size=b).astype(np.float32)
    mask = (rng.random((b, t)) < 0.7).astype(np.float32)
    mask[0:6] = 0.0  # prompts 0-2 filtered out: slice 0 (rows 0-7) keeps prompt 3 only
    hyper = {"kl_coef": 0.1} if kind == "grpo" else {}
    ref_of = lambda s: ref[s] if kind == "grpo" else None  # noqa: E731

    def whole(lp):
        return policy_loss(lp, behaviour, adv, mask, g, kind, aggregation, ref_of(...), **hyper)

    (want, want_metrics), want_grad = jax.value_and_grad(whole, has_aux=True)(jnp.asarray(logp))
    weights = loss_weights(mask, g, kind, aggregation)
    halves = (slice(0, 8), slice(8, 16))

    def sliced(lp):
        parts = [
            loss_sums(lp[s], behaviour[s], adv[s], mask[s], weights[s], kind, ref_of(s), **hyper)
            for s in halves
        ]
        return parts[0][0] + parts[1][0], combine_sums(parts[0][1], parts[1][1])

    (got, sums), got_grad = jax.value_and_grad(sliced, has_aux=True)(jnp.asarray(logp))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-8)
    got_metrics = metrics_from_sums(sums)
    for key, value in want_metrics.items():
        np.testing.assert_allclose(got_metrics[key], value, rtol=1e-5, err_msg=key)
    # The old way, a mean of per-slice normalised losses, weighs the lone prompt differently.
    per_slice = [
        policy_loss(
            logp[s], behaviour[s], adv[s], mask[s], g, kind, aggregation, ref_of(s), **hyper
        )
        for s in halves
    ]
    assert abs(float(np.mean([loss for loss, _ in per_slice])) - float(want)) > 1e-3


def test_grpo_k3_kl_penalty_by_hand():
    # Reference one nat above the policy on every token: delta = ln 2 -> k3 = 2 - ln 2 - 1.
    ref = LOGP + LN2
    plain, _ = _loss("grpo")
    loss, m = _loss("grpo", ref_logp_bt=ref, kl_coef=0.04)
    assert float(m["kl_ref"]) == pytest.approx(1 - LN2, rel=1e-5)
    assert float(loss) == pytest.approx(float(plain) + 0.04 * (1 - LN2), rel=1e-5)
    # GRPO's band is symmetric 0.2: row 0 token 1 -> min(2, 1.2) = 1.2; row 2 -> 2.4.
    assert float(plain) == pytest.approx(-(1 + 1.2 - 3 + 2.4) / 6, abs=1e-6)


def test_aggregate_weights_by_hand():
    values = np.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 0, 0]], np.float32)
    assert float(aggregate(values, mask, 2, "token")) == pytest.approx(10 / 4)
    assert float(aggregate(values, mask, 2, "sample")) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(values, mask, 2, "prompt")) == pytest.approx(10 / 4)
    assert float(aggregate(values, mask, 1, "prompt")) == pytest.approx((2 + 4) / 2)


# --------------------------------------------------------------------------- gradients


def test_cispo_keeps_gradient_on_capped_tokens():
    # Row 2's only token has rho 8 > 5: gradient of the loss there is -5 * A / count = -10 / 6.
    g = _grad("cispo")
    assert g[2, 0] == pytest.approx(-5 * 2 / 6, rel=1e-6)
    assert g[0, 1] == pytest.approx(-2 * 1 / 6, rel=1e-6)  # rho 2 under the cap: weight 2
    assert np.all(g[MASK == 0] == 0)


def test_dapo_zero_gradient_outside_band_in_advantage_direction():
    g = _grad("dapo")
    assert g[0, 1] == 0.0 and g[2, 0] == 0.0  # A > 0 and rho > 1.28
    assert g[0, 0] == pytest.approx(-1 / 6, rel=1e-6)  # inside: d(rho * A)/dlogp = rho * A
    # A < 0 and rho < 0.8 gets no gradient either; rho < 0.8 with A > 0 does.
    logp = LOGP.copy()
    logp[1, 0] = -0.5 + math.log(0.5)  # row 1 (A = -1), token 0: rho = 0.5
    g = np.asarray(jax.grad(lambda lp: _loss("dapo", logp=lp)[0])(logp))
    assert g[1, 0] == 0.0
    assert g[1, 1] == pytest.approx(1 / 6, rel=1e-6)


def test_gspo_with_unit_ratios_is_sequence_mean_reinforce():
    logp = jnp.asarray(BEHAVIOUR)  # all ratios 1

    def reinforce(lp):  # -(1 / #rows with tokens) * sum_b A_b * mean_t logp_bt
        n = MASK.sum(1)
        per_row = jnp.where(n > 0, jnp.sum(lp * MASK, 1) / np.maximum(n, 1), 0.0)
        return -jnp.sum(ADV * per_row) / 3

    g = jax.grad(lambda lp: _loss("gspo", "sample", logp=lp)[0])(logp)
    np.testing.assert_allclose(g, jax.grad(reinforce)(logp), atol=1e-6)


@pytest.mark.parametrize("aggregation", ["prompt", "sample", "token"])
def test_on_policy_gradients_of_cispo_dapo_grpo_coincide(aggregation):
    on_policy = lambda kind: jax.grad(  # noqa: E731
        lambda lp: policy_loss(lp, jax.lax.stop_gradient(lp), ADV, MASK, 2, kind, aggregation)[0]
    )(jnp.asarray(LOGP))
    cispo = on_policy("cispo")
    np.testing.assert_allclose(cispo, on_policy("dapo"), atol=1e-6)
    np.testing.assert_allclose(cispo, on_policy("grpo"), atol=1e-6)
    assert np.abs(np.asarray(cispo)).sum() > 0


def test_all_masked_batch_gives_zero_loss_and_gradient():
    zero = np.zeros_like(MASK)
    for kind in ("cispo", "dapo", "gspo", "grpo"):
        for aggregation in ("prompt", "sample", "token"):
            f = lambda lp: policy_loss(lp, BEHAVIOUR, ADV, zero, 2, kind, aggregation)[0]  # noqa: B023, E731
            loss, g = jax.value_and_grad(f)(jnp.asarray(LOGP))
            assert float(loss) == 0.0
            assert np.all(np.asarray(g) == 0.0)


# --------------------------------------------------------------------------- jit, sharding, errors


def test_jit_and_sharded_match_eager():
    rng = np.random.default_rng(0)
    b, t = 16, 24
    logp = rng.normal(-2, 0.5, (b, t)).astype(np.float32)
    behaviour = (logp + rng.normal(0, 0.3, (b, t))).astype(np.float32)
    adv = rng.normal(size=b).astype(np.float32)
    mask = (rng.random((b, t)) < 0.7).astype(np.float32)

    def fn(lp, bh, a, m):
        return jax.value_and_grad(lambda x: policy_loss(x, bh, a, m, 4, "cispo", "prompt")[0])(lp)

    eager = fn(logp, behaviour, adv, mask)
    jitted = jax.jit(fn)(logp, behaviour, adv, mask)
    mesh = sharding.make_mesh(MeshConfig(data=8))
    placed = [
        jax.device_put(x, sharding.batch_sharding(mesh, x.ndim))
        for x in (logp, behaviour, adv, mask)
    ]
    sharded = jax.jit(fn)(*placed)
    for other in (jitted, sharded):
        np.testing.assert_allclose(other[0], eager[0], rtol=1e-5)
        np.testing.assert_allclose(other[1], eager[1], rtol=1e-5, atol=1e-7)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="loss kind"):
        _loss("ppo")
    with pytest.raises(ValueError, match=r"unknown: \['eps_max'\]"):
        _loss("dapo", eps_max=3.0)
    with pytest.raises(ValueError, match="aggregation"):
        _loss("cispo", "group")
    with pytest.raises(ValueError, match="needs ref_logp_bt"):
        _loss("grpo", kl_coef=0.1)


# --------------------------------------------------------------------------- mismatch masks
# One prompt x two samples, T = 3, behaviour log-probs 0, so rho = exp(logp):
#   row 0: rho = [1, 2.5, 0.4], A = +1   (geometric mean (1 x 2.5 x 0.4)^(1/3) = 1)
#   row 1: rho = [1.5, 1.2, -], A = -1   (third token not counted; geometric mean 1.8^(1/2))
MM_LOGP = np.log(np.array([[1.0, 2.5, 0.4], [1.5, 1.2, 3.0]], np.float32))
MM_MASK = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
MM_ADV = np.array([1.0, -1.0], np.float32)


def _mm(kind="cispo", **mask):
    def loss(logp):
        return policy_loss(logp, jnp.zeros_like(logp), MM_ADV, MM_MASK, 2, kind, "token", **mask)

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(MM_LOGP))
    return float(value), metrics, np.asarray(grad)


def test_token_mismatch_mask_by_hand():
    # c = 2 keeps |log rho| <= log 2: 2.5 and 0.4 (1 / 0.4 = 2.5) go, 1, 1.5, 1.2 stay.
    # CISPO, token aggregation over the 5 counted tokens (weights stay 1/5 each):
    # J = 1 x 1 x ln 1 + 1.5 x (-1) x ln 1.5 + 1.2 x (-1) x ln 1.2; loss = -J / 5.
    loss, metrics, grad = _mm(mismatch_mask="token", mismatch_threshold=2.0)
    assert loss == pytest.approx((1.5 * math.log(1.5) + 1.2 * math.log(1.2)) / 5, rel=1e-5)
    assert float(metrics["mismatch_masked"]) == pytest.approx(2 / 5)
    # d loss / d logp = -w sg(rho) A on kept tokens, 0 on dropped ones.
    want = np.array([[-1.0 / 5, 0.0, 0.0], [1.5 / 5, 1.2 / 5, 0.0]])
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)
    none_loss, none_metrics, _ = _mm()
    assert float(none_metrics["mismatch_masked"]) == 0.0
    j = 2.5 * math.log(2.5) + 0.4 * math.log(0.4) - 1.5 * math.log(1.5) - 1.2 * math.log(1.2)
    assert none_loss == pytest.approx(-j / 5, rel=1e-5)


def test_sequence_mismatch_mask_by_hand():
    # Geometric means: row 0 exactly 1, row 1 sqrt(1.8) = 1.342. c = 1.3 drops row 1 whole;
    # c = 2 keeps both (row 0's 2.5 and 0.4 cancel: a token mask would drop them).
    loss, metrics, grad = _mm(mismatch_mask="sequence", mismatch_threshold=1.3)
    assert loss == pytest.approx(-(2.5 * math.log(2.5) + 0.4 * math.log(0.4)) / 5, rel=1e-5)
    assert float(metrics["mismatch_masked"]) == pytest.approx(2 / 5)
    np.testing.assert_allclose(grad[1], 0.0)
    np.testing.assert_allclose(grad[0], [-1.0 / 5, -2.5 / 5, -0.4 / 5], rtol=1e-5)
    _, metrics, _ = _mm(mismatch_mask="sequence", mismatch_threshold=2.0)
    assert float(metrics["mismatch_masked"]) == 0.0


@pytest.mark.parametrize("kind", ["cispo", "dapo", "grpo", "gspo"])
def test_mismatch_masks_drop_the_same_tokens_with_every_loss_kind(kind):
    _, _, full = _mm(kind)
    if kind != "gspo":  # per-token ratios: the kept tokens' gradients are untouched
        _, metrics, grad = _mm(kind, mismatch_mask="token")
        assert float(metrics["mismatch_masked"]) == pytest.approx(2 / 5)
        np.testing.assert_array_equal(grad[0, 1:], 0.0)
        np.testing.assert_allclose(grad[1], full[1], rtol=1e-6)
        np.testing.assert_allclose(grad[0, 0], full[0, 0], rtol=1e-6)
    _, metrics, grad = _mm(kind, mismatch_mask="sequence", mismatch_threshold=1.3)
    assert float(metrics["mismatch_masked"]) == pytest.approx(2 / 5)
    np.testing.assert_array_equal(grad[1], 0.0)
    assert np.abs(full[1]).max() > 0


def test_mismatch_mask_settings_are_checked_and_named():
    from jaxrl_scale.config import ConfigError, load_config

    for bad, message in (
        (["loss.mismatch_threshold=1.0"], "loss.mismatch_threshold: must be > 1"),
        (["loss.mismatch_mask=always"], "loss.mismatch_mask: expected one of 'none', 'token'"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config("asset:demo.yaml", bad)
