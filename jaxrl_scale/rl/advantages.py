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

    A NaN reward marks a row that has none (an episode its environment failed, rl/episodes.py):
    the group's baseline and spread come from its other rows, and a group with fewer than 2
    rewards left carries no comparison and is dropped. With every reward present this is the
    plain group computation.

    Returns:
      adv_b: float32 [B]; 0 on rows of zero-variance groups and on rows without a reward.
      keep_b: bool [B]; False on every row of a group whose rewards are all equal (those
        prompts carry no learning signal and are dropped from the loss and its normaliser),
        and on every row without a reward.
    """
    rewards_b = jnp.asarray(rewards_b, jnp.float32)
    (b,) = rewards_b.shape
    if group_size < 1 or b % group_size:
        raise ValueError(f"batch of {b} rewards does not split into groups of {group_size}")
    if baseline == "rloo" and group_size < 2:
        raise ValueError("the leave-one-out baseline needs group_size >= 2")
    rewards_pg = rewards_b.reshape(-1, group_size)
    valid_pg = jnp.isfinite(rewards_pg)
    n_p1 = jnp.sum(valid_pg, axis=1, keepdims=True)
    present_pg = jnp.where(valid_pg, rewards_pg, 0.0)
    mean_p1 = jnp.sum(present_pg, axis=1, keepdims=True) / jnp.maximum(n_p1, 1)
    dev_pg = jnp.where(valid_pg, rewards_pg - mean_p1, 0.0)
    adv_pg = dev_pg
    if baseline == "rloo":
        adv_pg = dev_pg * n_p1 / jnp.maximum(n_p1 - 1, 1)
    elif baseline != "mean":
        raise ValueError(f"baseline must be 'mean' or 'rloo', got {baseline!r}")
    highest_p1 = jnp.max(jnp.where(valid_pg, rewards_pg, -jnp.inf), axis=1, keepdims=True)
    lowest_p1 = jnp.min(jnp.where(valid_pg, rewards_pg, jnp.inf), axis=1, keepdims=True)
    keep_pg = valid_pg & (n_p1 >= 2) & (highest_p1 > lowest_p1)

    if normalize == "prompt":
        std_p1 = jnp.sqrt(jnp.sum(dev_pg**2, axis=1, keepdims=True) / jnp.maximum(n_p1, 1))
        adv_pg = adv_pg / (std_p1 + eps)
    elif normalize == "batch":
        n_kept = jnp.maximum(jnp.sum(keep_pg), 1)
        mean = jnp.sum(jnp.where(keep_pg, adv_pg, 0.0)) / n_kept
        var = jnp.sum(jnp.where(keep_pg, (adv_pg - mean) ** 2, 0.0)) / n_kept
        adv_pg = adv_pg / (jnp.sqrt(var) + eps)
    elif normalize != "none":
        raise ValueError(f"normalize must be 'batch', 'prompt' or 'none', got {normalize!r}")
    adv_pg = jnp.where(keep_pg, adv_pg, 0.0)
    return adv_pg.reshape(b), keep_pg.reshape(b)
