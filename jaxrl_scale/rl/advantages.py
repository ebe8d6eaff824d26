"""Group-relative advantages (pure array functions).

Shapes: B = P x G sequences, P prompts, G samples per prompt; the G rows of a prompt are
consecutive.
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp

Normalize = Literal["batch", "prompt", "none"]
Baseline = Literal["mean", "rloo"]


def group_advantages(
    rewards_b,
    group_size: int,
    normalize: Normalize = "batch",
    eps: float = 1e-6,
    baseline: Baseline = "mean",
):
    """Advantages A_i = r_i - baseline of the prompt's group, normalised, with a keep mask.

    baseline "mean": the group's mean reward; "rloo": the mean of the *other* G - 1 rewards,
    which equals G / (G - 1) * (r_i - mean).
    normalize "batch" (ScaleRL): divide by the population std of the advantages of kept prompts
    (+ eps); "prompt" (GRPO): by each group's population reward std + eps; "none" (Dr. GRPO).

    Returns:
      adv_b: float32 [B]; 0 on rows of zero-variance groups.
      keep_b: bool [B]; False on every row of a group whose G rewards are all equal (those
        prompts carry no learning signal and are dropped from the loss and its normaliser).
    """
    rewards_b = jnp.asarray(rewards_b, jnp.float32)
    (b,) = rewards_b.shape
    if group_size < 1 or b % group_size:
        raise ValueError(f"batch of {b} rewards does not split into groups of {group_size}")
    if baseline == "rloo" and group_size < 2:
        raise ValueError("the leave-one-out baseline needs group_size >= 2")
    rewards_pg = rewards_b.reshape(-1, group_size)
    mean_p1 = jnp.mean(rewards_pg, axis=1, keepdims=True)
    adv_pg = rewards_pg - mean_p1
    if baseline == "rloo":
        adv_pg = adv_pg * group_size / (group_size - 1)
    elif baseline != "mean":
        raise ValueError(f"baseline must be 'mean' or 'rloo', got {baseline!r}")
    keep_p1 = jnp.any(rewards_pg != rewards_pg[:, :1], axis=1, keepdims=True)
    keep_pg = jnp.broadcast_to(keep_p1, adv_pg.shape)

    if normalize == "prompt":
        adv_pg = adv_pg / (jnp.std(rewards_pg, axis=1, keepdims=True) + eps)
    elif normalize == "batch":
        n_kept = jnp.maximum(jnp.sum(keep_pg), 1)
        mean = jnp.sum(jnp.where(keep_pg, adv_pg, 0.0)) / n_kept
        var = jnp.sum(jnp.where(keep_pg, (adv_pg - mean) ** 2, 0.0)) / n_kept
        adv_pg = adv_pg / (jnp.sqrt(var) + eps)
    elif normalize != "none":
        raise ValueError(f"normalize must be 'batch', 'prompt' or 'none', got {normalize!r}")
    adv_pg = jnp.where(keep_pg, adv_pg, 0.0)
    return adv_pg.reshape(b), keep_pg.reshape(b)
