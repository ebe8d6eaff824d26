"""The train step: a pure function (state, batch) -> (state, metrics), compiled once.

Shapes: B = P x G sequences, L prompt slots, N completion slots.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_scale.models.lora import merge_policy
from jaxrl_scale.models.moe import rerouted
from jaxrl_scale.models.policy import completion_logprobs, route_shapes, token_logprobs
from jaxrl_scale.parallel.sharding import LOGICAL_RULES, replicated, traced_on
from jaxrl_scale.rl.config import LossConfig, OptimConfig
from jaxrl_scale.rl.losses import (
    combine_sums,
    loss_sums,
    loss_weights,
    metrics_from_sums,
    packed_loss_weights,
)
from jaxrl_scale.rl.packing import PackedBatch, micro_steps, packed_logprobs

if TYPE_CHECKING:  # the root config composes every part's section
    from jaxrl_scale.config import ExperimentConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """What an optimizer step updates. `params` are the trainable parameters: every one, or
    with LoRA the adapters alone, whose frozen base is an argument of the step beside the
    state (lora.py), never donated and never copied into it."""

    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array  # optimizer steps taken (the policy version)
    nonfinite: jax.Array  # consecutive skipped updates
    ref_params: nnx.State | None = None  # frozen reference policy for a KL penalty (grpo)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """One RL batch of B = P x G finished completions: G consecutive rows continue the same
    prompt (the trainer runs each prompt once for its group), with per-token behaviour
    log-probs and advantages."""

    prompt_tokens: jax.Array  # [B, L] int32, left-padded; equal within a group
    prompt_mask: jax.Array  # [B, L] bool: real prompt tokens
    tokens: jax.Array  # [B, N] int32: completion tokens
    mask: jax.Array  # [B, N] bool: tokens emitted (sampled or inserted), padding after
    loss_mask: jax.Array  # [B, N] float32: sampled tokens of kept rows
    behavior_logp: jax.Array  # [B, N] float32
    adv: jax.Array  # [B] float32
    # Router replay (model.router_replay): [B, L + N, routed layers, K] the experts the sampler
    # sent each prompt and completion token to (ModelConfig.route_dtype); None without.
    routes: jax.Array | None = None

    @classmethod
    def shapes(cls, rows: int, prompt_len: int, new_tokens: int, model=None) -> Batch:
        """Shapes and dtypes of a batch (e.g. to derive its shardings before one exists);
        `model` (a ModelConfig) adds the routes a router-replay run's batches carry."""
        s = jax.ShapeDtypeStruct
        return cls(
            prompt_tokens=s((rows, prompt_len), jnp.int32),
            prompt_mask=s((rows, prompt_len), jnp.bool_),
            tokens=s((rows, new_tokens), jnp.int32),
            mask=s((rows, new_tokens), jnp.bool_),
            loss_mask=s((rows, new_tokens), jnp.float32),
            behavior_logp=s((rows, new_tokens), jnp.float32),
            adv=s((rows,), jnp.float32),
            routes=route_shapes(model, rows, prompt_len + new_tokens),
        )

    @classmethod
    def from_rollout(cls, ro, adv_b, keep_b, xp=jnp) -> Batch:
        """Only sampled tokens of kept rows count. With `xp=numpy` and host arrays, the batch
        is built on the host."""
        n = ro.completion_tokens.shape[1]
        return cls(
            prompt_tokens=ro.prompt_tokens,
            prompt_mask=ro.prompt_mask,
            tokens=ro.completion_tokens,
            mask=xp.arange(n)[None, :] < ro.lengths[:, None],
            loss_mask=ro.completion_mask * xp.asarray(keep_b, xp.float32)[:, None],
            behavior_logp=ro.behavior_logp,
            adv=xp.asarray(adv_b, xp.float32),
            routes=ro.routes,
        )


def make_optimizer(cfg: OptimConfig, *, total_steps: int) -> optax.GradientTransformation:
    """The one place an optimiser is built (RL and warm start): AdamW after global-norm
    clipping, linear warm-up, then a constant learning rate or a cosine decay that reaches 0
    at `total_steps`."""
    warmup = optax.linear_schedule(0.0, cfg.learning_rate, max(cfg.warmup_steps, 1))
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(
            cfg.learning_rate, max(total_steps - cfg.warmup_steps, 1)
        )
    else:
        decay = optax.constant_schedule(cfg.learning_rate)
    schedule = optax.join_schedules([warmup, decay], [cfg.warmup_steps])
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, eps=cfg.adam_eps, weight_decay=cfg.weight_decay),
    )


def init_train_state(
    params: nnx.State, tx: optax.GradientTransformation, *, reference: bool = False
) -> TrainState:
    """A fresh state at version 0; `reference` keeps a frozen copy of `params` for a KL term."""
    return TrainState(
        params=params,
        opt_state=tx.init(params),
        step=jnp.zeros((), jnp.int32),
        nonfinite=jnp.zeros((), jnp.int32),
        ref_params=jax.tree.map(jnp.copy, params) if reference else None,
    )


def _rl_loss(
    params,
    ref_params,
    batch: Batch | PackedBatch,
    weights_bt,
    frozen=None,
    *,
    graphdef,
    group_size,
    loss_cfg: LossConfig,
    temperature,
):
    """The loss of a slice of whole prompt groups (or of packed rows) under the whole batch's
    token weights, and its additive sums (losses.loss_sums)."""
    packed = isinstance(batch, PackedBatch)

    def logprobs(p):  # (log-probs, the routers' own choices or None)
        model = merge_policy(graphdef, p, frozen)
        if packed:
            return packed_logprobs(model, batch, temperature=temperature, return_routes=True)
        return completion_logprobs(
            model,
            batch.prompt_tokens[::group_size],
            batch.prompt_mask[::group_size],
            batch.tokens,
            batch.mask,
            temperature=temperature,
            routes=batch.routes,
            return_routes=True,
        )

    ref_logp = None if ref_params is None else jax.lax.stop_gradient(logprobs(ref_params)[0])
    logp, chosen = logprobs(params)
    loss, sums = loss_sums(
        logp,
        batch.behavior_logp,
        batch.adv,
        batch.loss_mask,
        weights_bt,
        loss_cfg.kind,
        ref_logp,
        seq_ids=batch.seq if packed else None,
        num_seqs=batch.num_seqs if packed else None,
        mismatch_mask=loss_cfg.mismatch_mask,
        mismatch_threshold=loss_cfg.mismatch_threshold,
        **loss_cfg.hyper(),
    )
    if batch.routes is not None:
        sums = {**sums, **_reroute_sums(chosen, batch, batch.loss_mask)}
    return loss, sums


def _reroute_sums(chosen, batch: Batch | PackedBatch, mask):
    """Router replay's telemetry over the loss's tokens: routing decisions (token x routed
    layer) and tokens where the trainer's router would have chosen other experts than the
    replayed ones (`moe.rerouted`)."""
    replayed = batch.routes
    if not isinstance(batch, PackedBatch):  # the completions' columns
        replayed = replayed[:, batch.prompt_tokens.shape[1] :]
    differs = rerouted(chosen, replayed).astype(jnp.float32)  # [..., routed layers]
    counted = (jnp.asarray(mask) > 0).astype(jnp.float32)
    return {
        "routed": jnp.sum(counted) * differs.shape[-1],
        "routed_tokens": jnp.sum(counted),
        "rerouted": jnp.sum(differs * counted[..., None]),
        "rerouted_tokens": jnp.sum(jnp.max(differs, axis=-1) * counted),
    }


def _micro(tree, m: int, mesh=None):
    """[B, ...] -> [m, B / m, ...]; slices hold whole prompt groups (B / m is a multiple of G),
    or whole packed rows.

    With `mesh`, each slice's rows stay split over the batch axes. Left to itself the
    partitioner keeps the batch sharding on the leading axis, which is now the slice index:
    every device would then run every row of every slice (m-fold work and activations)."""

    def one(x):
        x = x.reshape(m, x.shape[0] // m, *x.shape[1:])
        if mesh is None:
            return x
        spec = PartitionSpec(None, LOGICAL_RULES["batch"], *([None] * (x.ndim - 2)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(one, tree)


def batch_weights(batch: Batch | PackedBatch, group_size: int, loss_cfg: LossConfig):
    """The whole batch's per-token loss weights (losses.loss_weights), in the batch's layout."""
    kind, aggregation = loss_cfg.kind, loss_cfg.aggregation
    if isinstance(batch, PackedBatch):
        return packed_loss_weights(
            batch.loss_mask, batch.seq, batch.num_seqs, group_size, kind, aggregation
        )
    return loss_weights(batch.loss_mask, group_size, kind, aggregation)


def train_step(
    state: TrainState,
    batch: Batch | PackedBatch,
    frozen=None,
    *,
    graphdef,
    tx,
    group_size: int,
    loss_cfg: LossConfig,
    temperature: float,
    micro_batches: int = 1,
    rows_per_micro: int | None = None,
    mesh=None,
):
    """One optimizer step on the RL loss. A non-finite loss or gradient leaves the parameters
    and optimizer state unchanged and counts the skip (metrics["skipped"]).

    A packed batch (packing.py) runs the same loss over its rows; with `rows_per_micro`, as
    m = ceil(R / rows_per_micro) micro-steps of R / m rows (a token budget per micro-step,
    `packing.step_rows`: R is a compiled shape, so each row count compiles with its own
    number of micro-steps).

    With `micro_batches` = m, the batch runs as m slices of whole prompt groups (memory / m),
    each under the token weights of the whole batch (losses.loss_weights), so the summed
    slice losses and gradients equal the whole batch's whatever filtering left in each slice.

    `frozen`: a LoRA policy's base (lora.py); gradients are taken for `state.params` only.
    """
    loss_fn = functools.partial(
        _rl_loss,
        frozen=frozen,
        graphdef=graphdef,
        group_size=group_size,
        loss_cfg=loss_cfg,
        temperature=temperature,
    )
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    weights_bt = batch_weights(batch, group_size, loss_cfg)
    if rows_per_micro and isinstance(batch, PackedBatch):
        micro_batches = micro_steps(batch.shape[0], rows_per_micro)
    if micro_batches == 1:
        (loss, sums), grads = grad_fn(state.params, state.ref_params, batch, weights_bt)
    else:  # gradient accumulation: the slices' unnormalised contributions add up

        def accumulate(carry, micro):
            (loss, sums), grads = grad_fn(state.params, state.ref_params, *micro)
            c_loss, c_sums, c_grads = carry
            return (
                c_loss + loss,
                combine_sums(c_sums, sums),
                jax.tree.map(jnp.add, c_grads, grads),
            ), None

        slices = _micro((batch, weights_bt), micro_batches, mesh)
        (loss, sums), grads = jax.eval_shape(
            grad_fn, state.params, state.ref_params, *jax.tree.map(lambda x: x[0], slices)
        )
        identity = lambda key, s: jnp.full(  # noqa: E731
            s.shape,
            -jnp.inf if key.endswith("_max") else jnp.inf if key.endswith("_min") else 0,
            s.dtype,
        )
        zeros = (
            jnp.zeros(loss.shape, loss.dtype),
            {key: identity(key, s) for key, s in sums.items()},
            jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), grads),
        )
        (loss, sums, grads), _ = jax.lax.scan(accumulate, zeros, slices)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
    new_state = TrainState(
        params=keep(params, state.params),
        opt_state=keep(opt_state, state.opt_state),
        step=state.step + finite.astype(jnp.int32),
        nonfinite=jnp.where(finite, 0, state.nonfinite + 1),
        ref_params=state.ref_params,
    )
    metrics = {
        **metrics_from_sums(sums),
        **_reroute_metrics(sums),
        "loss": loss,
        "grad_norm": grad_norm,
        "skipped": 1 - finite.astype(jnp.int32),
        "nonfinite_in_a_row": new_state.nonfinite,  # read by the loop (one step late)
    }
    return new_state, metrics


def _reroute_metrics(sums) -> dict:
    """router_differs: the fraction of the loss tokens' routing decisions (token x routed
    layer) where the trainer's router would have chosen other experts than the sampler's it
    replays; router_differs_tokens: the fraction of those tokens with such a layer. Only with
    router replay."""
    if "routed" not in sums:
        return {}
    return {
        "router_differs": sums["rerouted"] / jnp.maximum(sums["routed"], 1.0),
        "router_differs_tokens": sums["rerouted_tokens"] / jnp.maximum(sums["routed_tokens"], 1.0),
    }


def compile_train_step(
    graphdef,
    tx,
    *,
    group_size,
    loss_cfg,
    temperature,
    micro_batches=1,
    rows_per_micro=None,
    state_sharding=None,
    batch_sharding=None,
    frozen_sharding=None,
):
    """jit of `train_step` with the state donated. With `state_sharding` (a TrainState of
    shardings) and `batch_sharding` (a Batch of shardings) the layout is explicit: the state
    comes out where it went in and metrics come out replicated; without them, shardings follow
    the inputs' placement. With LoRA the step takes the frozen base third, (state, batch,
    frozen), laid out as `frozen_sharding` and not donated."""
    step = functools.partial(
        train_step,
        graphdef=graphdef,
        tx=tx,
        group_size=group_size,
        loss_cfg=loss_cfg,
        temperature=temperature,
        micro_batches=micro_batches,
        rows_per_micro=rows_per_micro,
    )
    if state_sharding is None:
        return jax.jit(step, donate_argnums=0)
    mesh = jax.tree.leaves(batch_sharding)[0].mesh

    def step_on_mesh(state, batch, *frozen):
        with traced_on(mesh):
            return step(state, batch, *frozen, mesh=mesh)

    in_shardings = (state_sharding, batch_sharding)
    if frozen_sharding is not None:
        in_shardings += (frozen_sharding,)
    return jax.jit(
        step_on_mesh,
        in_shardings=in_shardings,
        out_shardings=(state_sharding, replicated(mesh)),
        donate_argnums=0,
    )


def compile_run_step(
    cfg: ExperimentConfig,
    graphdef,
    tx,
    *,
    state_sharding,
    batch_sharding,
    frozen_sharding=None,
    rows_per_micro=None,
):
    """`compile_train_step` with a run's settings from `cfg` (group size, loss, sampling
    temperature, micro-batches; packed steps' rows per micro-step from the rollout worker):
    the step a run trains with and `jaxrl-scale memory` plans."""
    return compile_train_step(
        graphdef,
        tx,
        group_size=cfg.train.group_size,
        loss_cfg=cfg.loss,
        temperature=cfg.sampler.temperature,
        micro_batches=cfg.train.micro_batches,
        rows_per_micro=rows_per_micro,
        state_sharding=state_sharding,
        batch_sharding=batch_sharding,
        frozen_sharding=frozen_sharding,
    )


def sft_step(params, opt_state, tokens, attention_mask, target_mask, frozen=None, *, graphdef, tx):
    """One supervised step: maximise the mean log-likelihood of the target tokens (of
    `params`, the trainable parameters, over a LoRA policy's `frozen` base)."""

    def loss_fn(params):
        model = merge_policy(graphdef, params, frozen)
        logp = token_logprobs(model, tokens, mask_bt=attention_mask)
        return -jnp.sum(logp * target_mask) / jnp.maximum(jnp.sum(target_mask), 1.0)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
