"""Policy-gradient objectives: CISPO, DAPO, GSPO, GRPO as one surrogate with the variant as data.

Shapes: B = P x G sequences (a prompt's G rows consecutive), T tokens. Inputs are per-token
log-probs of the sampled tokens under the current policy (`logp_bt`, differentiable) and under
the policy that sampled them (`behavior_logp_bt`), advantages `adv_b` and a mask of the tokens
that count (completion tokens of kept rows). The loss never sees [B, T, V] logits.

Per-token objective J_bt (maximised; the loss is -sum_bt w_bt J_bt):
  capped IS (CISPO):  sg(min(rho, eps_max)) * A * logp        rho = exp(logp - behavior_logp)
  clip (DAPO, GRPO):  min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)
  GSPO:               the clip surrogate on the sequence ratio s = exp(mean_t log rho_t),
                      shared by every token of the sequence.

The aggregation is a per-token weight w_bt that depends only on the mask (`aggregation_weights`),
so the loss is a plain weighted sum: split a batch into micro-batches, give each slice the
weights of the whole batch, and the slices' losses and gradients add up to the whole batch's
exactly (`loss_sums` + `combine_sums`), however unevenly zero-variance filtering left them.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

Aggregation = Literal["prompt", "sample", "token"]
MismatchMask = Literal["none", "token", "sequence"]


@dataclasses.dataclass(frozen=True)
class Surrogate:
    """How one loss kind turns ratios into an objective, and its default hyper-parameters."""

    form: Literal["capped_is", "clip"]
    ratio: Literal["token", "sequence"]
    defaults: tuple[tuple[str, float], ...]


KINDS: dict[str, Surrogate] = {
    "cispo": Surrogate("capped_is", "token", (("eps_max", 5.0),)),
    "dapo": Surrogate("clip", "token", (("eps_low", 0.2), ("eps_high", 0.28))),
    "gspo": Surrogate("clip", "sequence", (("eps_low", 3e-4), ("eps_high", 4e-4))),
    "grpo": Surrogate("clip", "token", (("eps_low", 0.2), ("eps_high", 0.2), ("kl_coef", 0.0))),
}


def _safe_div(num, den):
    """num / den where den > 0, else 0, with a gradient that is never NaN."""
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def aggregation_weights(
    mask_bt, group_size: int, aggregation: Aggregation, *, equal_sequences: bool = False
):
    """Per-token weights w_bt >= 0 such that sum(values * w) is ScaleRL's aggregation.

    token:  1 / (counted tokens in the batch).
    sample: 1 / (the row's counted tokens x rows with tokens).
    prompt: 1 / (the prompt's counted tokens over its G rows x prompts with tokens); with
            `equal_sequences` (GSPO, whose objective is per sequence), each row with tokens
            weighs the same within its prompt: 1 / (row tokens x its prompt's rows with tokens
            x prompts with tokens).
    Masked tokens weigh 0; an all-masked batch has all-zero weights.
    """
    mask_bt = jnp.asarray(mask_bt, jnp.float32)
    if aggregation == "token":
        return _safe_div(mask_bt, jnp.sum(mask_bt))
    row_b = _row_weights(jnp.sum(mask_bt, axis=1), group_size, aggregation, equal_sequences)
    return mask_bt * row_b[:, None]


def _row_weights(n_b, group_size: int, aggregation: Aggregation, equal_sequences: bool):
    """The per-sequence factor of the "sample" and "prompt" weights, from each sequence's
    counted tokens n_b [B]."""
    if aggregation == "sample":
        row_b = _safe_div(1.0, n_b) / jnp.maximum(jnp.sum(n_b > 0), 1)
    elif aggregation == "prompt":
        n_pg = n_b.reshape(-1, group_size)
        prompts = jnp.maximum(jnp.sum(jnp.sum(n_pg, axis=1) > 0), 1)
        if equal_sequences:
            rows_p1 = jnp.sum(n_pg > 0, axis=1, keepdims=True)
            row_pg = _safe_div(1.0, n_pg * rows_p1)
        else:
            row_pg = jnp.broadcast_to(
                _safe_div(1.0, jnp.sum(n_pg, axis=1, keepdims=True)), n_pg.shape
            )
        row_b = row_pg.reshape(-1) / prompts
    else:
        raise ValueError(f"aggregation must be 'prompt', 'sample' or 'token', got {aggregation!r}")
    return row_b


def aggregate(values_bt, mask_bt, group_size: int, aggregation: Aggregation):
    """Masked mean of per-token values, as ScaleRL defines the three aggregations.

    token:  sum over all counted tokens / their count.
    sample: per sequence, sum / its token count; then the mean over sequences with tokens.
    prompt: per prompt, the sum over its G sequences' tokens / their total count; then the
            mean over prompts with tokens.
    Masked tokens and empty rows or prompts add nothing to any sum or count; all masked -> 0.
    """
    weights_bt = aggregation_weights(mask_bt, group_size, aggregation)
    return jnp.sum(jnp.where(weights_bt > 0, values_bt * weights_bt, 0.0))


def _hyper(kind: str, overrides: dict[str, float]) -> dict[str, float]:
    if kind not in KINDS:
        raise ValueError(f"loss kind must be one of {sorted(KINDS)}, got {kind!r}")
    defaults = dict(KINDS[kind].defaults)
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(f"{kind} loss takes {sorted(defaults)}; unknown: {unknown}")
    return {**defaults, **overrides}


def loss_weights(mask_bt, group_size: int, kind: str, aggregation: Aggregation):
    """The aggregation weights `kind` uses: GSPO's objective is per sequence, so under prompt
    aggregation each of a prompt's sequences weighs the same (the GSPO paper's 1/G), not in
    proportion to its length."""
    _hyper(kind, {})
    equal = KINDS[kind].ratio == "sequence"
    return aggregation_weights(mask_bt, group_size, aggregation, equal_sequences=equal)


def packed_loss_weights(
    mask, seq_ids, num_seqs: int, group_size: int, kind: str, aggregation: Aggregation
):
    """`loss_weights` for tokens in any layout (packing.py's rows) whose sequence is
    `seq_ids` (0..num_seqs-1; num_seqs for tokens of no sequence): the same weight per token
    as the padded batch's, from segment sums over `seq_ids`."""
    _hyper(kind, {})
    mask = jnp.asarray(mask, jnp.float32)
    if aggregation == "token":
        return _safe_div(mask, jnp.sum(mask))
    n_b = jax.ops.segment_sum(mask.ravel(), seq_ids.ravel(), num_seqs + 1)[:num_seqs]
    equal = KINDS[kind].ratio == "sequence"
    row_b = _row_weights(n_b, group_size, aggregation, equal)
    return mask * jnp.append(row_b, 0.0)[seq_ids]


def loss_sums(
    logp_bt,
    behavior_logp_bt,
    adv_b,
    mask_bt,
    weights_bt,
    kind: str = "cispo",
    ref_logp_bt=None,
    seq_ids=None,
    num_seqs: int | None = None,
    mismatch_mask: MismatchMask = "none",
    mismatch_threshold: float = 2.0,
    **hyper: float,
):
    """The loss of (a slice of) a batch under given aggregation weights, and additive sums.

    With `weights_bt` from the whole batch (`loss_weights`), the losses of its slices add up to
    the whole batch's loss, and so do their gradients. The sums combine across slices with
    `combine_sums` (keys ending in _max / _min take the maximum / minimum, the rest add) and
    become metrics with `metrics_from_sums`.

    Layouts: rows are sequences ([B, T], `adv_b` [B]), or, with `seq_ids` (packing.py), any
    token layout whose tokens name their sequence (0..num_seqs-1, num_seqs for none), with
    `adv_b` given per token and `weights_bt` from `packed_loss_weights`.

    `mismatch_mask` (`mismatch_keep`): "token" or "sequence" drops the objective of tokens
    (of whole sequences) whose ratio lies outside [1 / mismatch_threshold, mismatch_threshold];
    they keep their aggregation weight, so the whole-batch weights stay exact.
    """
    h = _hyper(kind, hyper)
    surrogate = KINDS[kind]
    mask_bt = jnp.asarray(mask_bt, jnp.float32)
    log_rho_bt = logp_bt - behavior_logp_bt
    if seq_ids is None:
        adv_b1 = jnp.asarray(adv_b, jnp.float32)[:, None]
        n_b1 = jnp.sum(mask_bt, axis=1, keepdims=True)
        mean_log_rho_b1 = _safe_div(jnp.sum(log_rho_bt * mask_bt, axis=1, keepdims=True), n_b1)
        has_tokens_b, mean_log_rho_b = n_b1[:, 0] > 0, mean_log_rho_b1[:, 0]
    else:  # per-sequence sums over the tokens that name each sequence, read back per token
        adv_b1 = jnp.asarray(adv_b, jnp.float32)
        seq_sum = lambda x: jax.ops.segment_sum(x.ravel(), seq_ids.ravel(), num_seqs + 1)  # noqa: E731
        n_s = seq_sum(mask_bt)
        mean_log_rho_s = _safe_div(seq_sum(log_rho_bt * mask_bt), n_s)
        mean_log_rho_b1 = mean_log_rho_s[seq_ids]
        has_tokens_b, mean_log_rho_b = n_s[:num_seqs] > 0, mean_log_rho_s[:num_seqs]

    if surrogate.ratio == "sequence":
        ratio_bt = jnp.broadcast_to(jnp.exp(mean_log_rho_b1), logp_bt.shape)
    else:
        ratio_bt = jnp.exp(log_rho_bt)

    if surrogate.form == "capped_is":
        weight_bt = jax.lax.stop_gradient(jnp.clip(ratio_bt, 0.0, h["eps_max"]))
        objective_bt = weight_bt * adv_b1 * logp_bt
        clipped_bt = ratio_bt > h["eps_max"]
    else:
        low, high = 1.0 - h["eps_low"], 1.0 + h["eps_high"]
        objective_bt = jnp.minimum(ratio_bt * adv_b1, jnp.clip(ratio_bt, low, high) * adv_b1)
        clipped_bt = ((adv_b1 > 0) & (ratio_bt > high)) | ((adv_b1 < 0) & (ratio_bt < low))

    keep_bt = mismatch_keep(log_rho_bt, mean_log_rho_b1, mismatch_mask, mismatch_threshold)
    weighted = lambda x: jnp.sum(jnp.where(weights_bt > 0, x * weights_bt, 0.0))  # noqa: E731
    loss = -weighted(jnp.where(keep_bt, objective_bt, 0.0))
    kl_ref = jnp.zeros(())
    if h.get("kl_coef", 0.0):
        if ref_logp_bt is None:
            raise ValueError("kl_coef > 0 needs ref_logp_bt")
        delta_bt = ref_logp_bt - logp_bt
        kl_ref = weighted(jnp.exp(delta_bt) - delta_bt - 1.0)
        loss = loss + h["kl_coef"] * kl_ref

    counted_bt = mask_bt > 0
    total = lambda x: jnp.sum(jnp.where(counted_bt, x, 0.0))  # noqa: E731
    rho_bt = jnp.exp(jax.lax.stop_gradient(log_rho_bt))
    abs_log_rho_bt = jnp.abs(jax.lax.stop_gradient(log_rho_bt))
    seq_ratio_b = jnp.exp(jax.lax.stop_gradient(mean_log_rho_b))
    sums = {
        "count": jnp.sum(mask_bt),
        "clipped": total(clipped_bt.astype(jnp.float32)),
        "masked": total((~keep_bt).astype(jnp.float32)),
        "rho": total(rho_bt),
        "rho_sq": total(rho_bt * rho_bt),
        "abs_log_rho": total(abs_log_rho_bt),
        "k3": total(rho_bt - 1.0 - jax.lax.stop_gradient(log_rho_bt)),
        "kl_ref": jax.lax.stop_gradient(kl_ref),
        "rho_max": jnp.max(jnp.where(counted_bt, rho_bt, 0.0)),
        "abs_log_rho_max": jnp.max(jnp.where(counted_bt, abs_log_rho_bt, 0.0)),
        "seq_ratio_max": jnp.max(jnp.where(has_tokens_b, seq_ratio_b, 0.0)),
        "seq_ratio_min": jnp.min(jnp.where(has_tokens_b, seq_ratio_b, jnp.inf)),
    }
    return loss, sums


def mismatch_keep(log_rho_bt, mean_log_rho_b1, mask: MismatchMask, threshold: float):
    """Which tokens' objective counts under `loss.mismatch_mask`: all ("none"); those whose
    ratio rho = pi_trainer / pi_sampler lies in [1 / threshold, threshold] ("token", IcePop's
    mask); every token of the sequences whose geometric-mean ratio exp(mean_t log rho_t) does
    ("sequence"). Decided on the ratios' values, never differentiated."""
    if mask == "none":
        return jnp.ones(log_rho_bt.shape, jnp.bool_)
    bound = jnp.log(jnp.float32(threshold))
    if mask == "token":
        return jnp.abs(jax.lax.stop_gradient(log_rho_bt)) <= bound
    if mask == "sequence":
        keep = jnp.abs(jax.lax.stop_gradient(mean_log_rho_b1)) <= bound
        return jnp.broadcast_to(keep, log_rho_bt.shape)
    raise ValueError(f"mismatch_mask must be 'none', 'token' or 'sequence', got {mask!r}")


def combine_sums(a: dict, b: dict) -> dict:
    """Two slices' `loss_sums` as one: maxima stay maxima, minima minima, the rest add."""

    def one(key):
        if key.endswith("_max"):
            return jnp.maximum(a[key], b[key])
        if key.endswith("_min"):
            return jnp.minimum(a[key], b[key])
        return a[key] + b[key]

    return {key: one(key) for key in a}


def metrics_from_sums(sums: dict) -> dict:
    """Diagnostics over the counted tokens:
    clip_fraction: capped (CISPO) or outside the band in the advantage's direction (clip forms);
    rho_mean, rho_max: importance ratios pi_theta / pi_behaviour;
    mismatch, mismatch_max: mean and max |log pi_theta - log pi_behaviour| (sampler vs trainer);
    ess_fraction: effective sample size of the ratios as a fraction of the tokens,
      (sum rho)^2 / (n sum rho^2), 1 when every ratio is equal;
    seq_ratio_min, seq_ratio_max: range of the per-sequence geometric-mean ratios
      exp(mean_t log rho_t) (GSPO's sequence ratio);
    approx_kl: k3 estimate of KL(behaviour || current); kept_tokens; kl_ref (GRPO's penalty);
    mismatch_masked: the fraction of tokens `loss.mismatch_mask` dropped."""
    count = sums["count"]
    has_rows = jnp.isfinite(sums["seq_ratio_min"])
    return {
        "clip_fraction": _safe_div(sums["clipped"], count),
        "mismatch_masked": _safe_div(sums["masked"], count),
        "rho_mean": _safe_div(sums["rho"], count),
        "rho_max": sums["rho_max"],
        "mismatch": _safe_div(sums["abs_log_rho"], count),
        "mismatch_max": sums["abs_log_rho_max"],
        "ess_fraction": _safe_div(sums["rho"] ** 2, count * sums["rho_sq"]),
        "seq_ratio_min": jnp.where(has_rows, sums["seq_ratio_min"], 0.0),
        "seq_ratio_max": sums["seq_ratio_max"],
        "approx_kl": _safe_div(sums["k3"], count),
        "kept_tokens": count,
        "kl_ref": sums["kl_ref"],
    }


def policy_loss(
    logp_bt,
    behavior_logp_bt,
    adv_b,
    mask_bt,
    group_size: int,
    kind: str = "cispo",
    aggregation: Aggregation = "prompt",
    ref_logp_bt=None,
    mismatch_mask: MismatchMask = "none",
    mismatch_threshold: float = 2.0,
    **hyper: float,
):
    """The policy-gradient loss to minimise, and diagnostics.

    Args:
      logp_bt: log pi_theta of the sampled tokens, float32 [B, T] (the differentiable input).
      behavior_logp_bt: log-prob each token was sampled with, [B, T].
      adv_b: advantages [B].
      mask_bt: 1 on completion tokens of kept rows (the caller multiplies by keep_b).
      group_size: G; B must be a multiple of it.
      kind: "cispo" (eps_max 5), "dapo" (eps_low 0.2, eps_high 0.28), "gspo" (eps_low 3e-4,
        eps_high 4e-4) or "grpo" (eps_low = eps_high = 0.2, kl_coef 0); override via `hyper`.
      aggregation: "prompt", "sample" or "token" (see `aggregation_weights`; GSPO weighs a
        prompt's sequences equally).
      ref_logp_bt: reference-policy log-probs for GRPO's k3 KL penalty (needs kl_coef > 0).
      mismatch_mask, mismatch_threshold: tokens or sequences whose sampler/trainer ratio
        falls outside [1 / threshold, threshold] add nothing (`mismatch_keep`).

    Returns:
      (loss, metrics): scalar loss; metrics as `metrics_from_sums` describes.
    """
    if logp_bt.shape[0] % group_size:
        raise ValueError(
            f"batch of {logp_bt.shape[0]} rows does not split into groups of {group_size}"
        )
    weights_bt = loss_weights(mask_bt, group_size, kind, aggregation)
    loss, sums = loss_sums(
        logp_bt, behavior_logp_bt, adv_b, mask_bt, weights_bt, kind, ref_logp_bt,
        mismatch_mask=mismatch_mask, mismatch_threshold=mismatch_threshold, **hyper,
    )  # fmt: skip
    return loss, metrics_from_sums(sums)
