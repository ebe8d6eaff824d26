"""Policy-gradient objectives: CISPO, DAPO, GSPO, GRPO as one surrogate with the variant as data.

Shapes: B = P x G sequences (a prompt's G rows consecutive), T tokens. Inputs are per-token
log-probs of the sampled tokens under the current policy (`logp_bt`, differentiable) and under
the policy that sampled them (`behavior_logp_bt`), advantages `adv_b` and a mask of the tokens
that count (completion tokens of kept rows). The loss never sees [B, T, V] logits.

Per-token objective J_bt (maximised; the loss is -aggregate(J)):
  capped IS (CISPO):  sg(min(rho, eps_max)) * A * logp        rho = exp(logp - behavior_logp)
  clip (DAPO, GRPO):  min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)
  GSPO:               the clip surrogate on the sequence ratio s = exp(mean_t log rho_t),
                      shared by every token of the sequence.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

Aggregation = Literal["prompt", "sample", "token"]


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


def aggregate(values_bt, mask_bt, group_size: int, aggregation: Aggregation):
    """Masked mean of per-token values, as ScaleRL defines the three aggregations.

    token:  sum over all counted tokens / their count.
    sample: per sequence, sum / its token count; then the mean over sequences with tokens.
    prompt: per prompt, the sum over its G sequences' tokens / their total count; then the
            mean over prompts with tokens.
    Masked tokens and empty rows or prompts add nothing to any sum or count; all masked -> 0.
    """
    vm_bt = values_bt * mask_bt
    if aggregation == "token":
        return _safe_div(jnp.sum(vm_bt), jnp.sum(mask_bt))
    if aggregation == "sample":
        num_b, den_b = jnp.sum(vm_bt, axis=1), jnp.sum(mask_bt, axis=1)
    elif aggregation == "prompt":
        num_b = jnp.sum(vm_bt.reshape(-1, group_size * vm_bt.shape[1]), axis=1)
        den_b = jnp.sum(mask_bt.reshape(-1, group_size * mask_bt.shape[1]), axis=1)
    else:
        raise ValueError(f"aggregation must be 'prompt', 'sample' or 'token', got {aggregation!r}")
    present = den_b > 0
    return _safe_div(jnp.sum(_safe_div(num_b, den_b)), jnp.sum(present))


def _hyper(kind: str, overrides: dict[str, float]) -> dict[str, float]:
    if kind not in KINDS:
        raise ValueError(f"loss kind must be one of {sorted(KINDS)}, got {kind!r}")
    defaults = dict(KINDS[kind].defaults)
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(f"{kind} loss takes {sorted(defaults)}; unknown: {unknown}")
    return {**defaults, **overrides}


def policy_loss(
    logp_bt,
    behavior_logp_bt,
    adv_b,
    mask_bt,
    group_size: int,
    kind: str = "cispo",
    aggregation: Aggregation = "prompt",
    ref_logp_bt=None,
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
      aggregation: "prompt", "sample" or "token" (see `aggregate`).
      ref_logp_bt: reference-policy log-probs for GRPO's k3 KL penalty (needs kl_coef > 0).

    Returns:
      (loss, metrics): scalar loss; metrics of the counted tokens: clip_fraction (capped, for
      CISPO; outside the band in the advantage's direction, for clip forms), rho_mean, rho_max,
      mismatch (mean |log rho|), approx_kl (k3 of behaviour vs current), kept_tokens, kl_ref.
    """
    h = _hyper(kind, hyper)
    surrogate = KINDS[kind]
    mask_bt = jnp.asarray(mask_bt, jnp.float32)
    adv_b1 = jnp.asarray(adv_b, jnp.float32)[:, None]
    log_rho_bt = logp_bt - behavior_logp_bt
    if logp_bt.shape[0] % group_size:
        raise ValueError(
            f"batch of {logp_bt.shape[0]} rows does not split into groups of {group_size}"
        )

    if surrogate.ratio == "sequence":
        n_b1 = jnp.sum(mask_bt, axis=1, keepdims=True)
        mean_log_rho_b1 = _safe_div(jnp.sum(log_rho_bt * mask_bt, axis=1, keepdims=True), n_b1)
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

    loss = -aggregate(objective_bt, mask_bt, group_size, aggregation)
    kl_ref = jnp.zeros(())
    if h.get("kl_coef", 0.0):
        if ref_logp_bt is None:
            raise ValueError("kl_coef > 0 needs ref_logp_bt")
        delta_bt = ref_logp_bt - logp_bt
        kl_ref = aggregate(jnp.exp(delta_bt) - delta_bt - 1.0, mask_bt, group_size, aggregation)
        loss = loss + h["kl_coef"] * kl_ref

    count = jnp.sum(mask_bt)
    token_mean = lambda x: _safe_div(jnp.sum(x * mask_bt), count)  # noqa: E731
    rho_bt = jnp.exp(log_rho_bt)
    metrics = {
        "clip_fraction": token_mean(clipped_bt.astype(jnp.float32)),
        "rho_mean": token_mean(rho_bt),
        "rho_max": jnp.max(jnp.where(mask_bt > 0, rho_bt, 0.0)),
        "mismatch": token_mean(jnp.abs(log_rho_bt)),
        "approx_kl": token_mean(rho_bt - 1.0 - log_rho_bt),
        "kept_tokens": count,
        "kl_ref": kl_ref,
    }
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)
