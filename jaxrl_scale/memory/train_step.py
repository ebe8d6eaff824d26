"""The train step's plan: the step compiled from abstract state and batches (padded or
packed, full fine-tuning or LoRA), its arguments, outputs and temporaries per device."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxrl_scale.memory.abstract import (
    abstract_policy,
    breakdown,
    placed,
    tree_bytes,
)
from jaxrl_scale.parallel import sharding
from jaxrl_scale.rl.packing import PackedBatch, PackGeometry, micro_steps, step_rows
from jaxrl_scale.rl.step import Batch, TrainState, compile_run_step, make_optimizer

if TYPE_CHECKING:  # the root config composes every part's section
    from jaxrl_scale.config import ExperimentConfig


def train_step_memory(cfg: ExperimentConfig, mesh, prompt_len: int) -> dict[str, Any]:
    """The compiled train step's per-device bytes: arguments (parameters, optimizer state, the
    batch), temporaries (activations, gradients, the update), outputs not aliased. With LoRA
    the parameters are the frozen base (an argument of its own, not donated) and the adapters,
    the optimizer state is the adapters' alone, and `lora` compares with full fine-tuning."""
    graphdef, frozen, params = abstract_policy(cfg)
    params = placed(params, mesh)
    tx = make_optimizer(cfg.optim, total_steps=cfg.train.steps)
    scalar = jax.ShapeDtypeStruct((), np.int32, sharding=sharding.replicated(mesh))
    state = TrainState(
        params=params,
        # The moments are parameter-shaped States: their logical axes place them.
        opt_state=placed(jax.eval_shape(tx.init, params), mesh),
        step=scalar,
        nonfinite=scalar,
        ref_params=params if cfg.loss.kl_coef else None,
    )
    state_sharding = jax.tree.map(lambda x: x.sharding, state)
    rows = cfg.train.prompts_per_step * cfg.train.group_size
    # train.packing: auto may take either step (PackGeometry.of). A batch auto packs has
    # fewer positions than the padded step, so without a token budget the padded plan (every
    # completion at the budget) is the most a batch can need; with one, a packed micro-step
    # may hold up to the budget, more than a padded one: then the larger plan.
    ways = sharding.batch_ways(mesh)
    geometry = PackGeometry.of(cfg, prompt_len, ways) if cfg.train.packing else None
    frozen_sharding = None
    if frozen is not None:
        frozen = placed(frozen, mesh)
        frozen_sharding = jax.tree.map(lambda x: x.sharding, frozen)

    def plan(packed: dict[str, int] | None) -> dict[str, Any]:
        if packed is None:
            batch_shapes = Batch.shapes(rows, prompt_len, cfg.sampler.max_new_tokens, cfg.model)
        else:
            batch_shapes = PackedBatch.shapes(packed["rows"], packed["row_len"], rows, cfg.model)
        batch_sharding = sharding.batch_shardings(batch_shapes, mesh)
        batch = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            batch_shapes,
            batch_sharding,
        )
        args = (state, batch) if frozen is None else (state, batch, frozen)
        step = compile_run_step(
            cfg, graphdef, tx, state_sharding=state_sharding, batch_sharding=batch_sharding,
            frozen_sharding=frozen_sharding,
            rows_per_micro=None if packed is None else geometry.rows_per_micro,
        )  # fmt: skip
        out = breakdown(step.lower(*args).compile())
        if packed is None:
            out["auto_padded"] = geometry is not None  # train.packing: auto, planned padded
            out["rows_per_micro_batch"] = rows // cfg.train.micro_batches
            seq = prompt_len + cfg.sampler.max_new_tokens  # a completion's row, prompt shared
            out["positions_per_micro_batch_per_shard"] = out["rows_per_micro_batch"] // ways * seq
        else:
            out["rows_per_micro_batch"] = packed["rows_per_micro_batch"]
            out["positions_per_micro_batch_per_shard"] = (
                packed["rows_per_micro_batch"] // ways * packed["row_len"]
            )
            out["packed"] = packed
        return out

    candidates = []
    if geometry is None or geometry.auto:
        candidates.append(plan(None))
    if geometry is not None and (not geometry.auto or cfg.train.tokens_per_micro_batch):
        candidates.append(plan(_packed_plan(cfg, geometry, prompt_len)))
    out = max(candidates, key=lambda part: part["per_device_bytes"])
    trainable = tree_bytes(state.params)
    out["parameters_bytes"] = trainable + (0 if frozen is None else tree_bytes(frozen))
    out["optimizer_state_bytes"] = tree_bytes(state.opt_state)
    if frozen is not None:
        out["lora"] = _lora_state(cfg, mesh, tx, frozen, trainable, out)
    return out


def _packed_plan(cfg: ExperimentConfig, geometry: PackGeometry, prompt_len: int) -> dict[str, int]:
    """The packed step a plan compiles (train.packing): rows of the run's length, as many as a
    batch needs when every completion runs to the budget (the most it can need; the rows'
    count changes the batch arguments and the number of micro-steps, not the activations of
    one micro-step, which `train.tokens_per_micro_batch` sets)."""
    n, g = cfg.sampler.max_new_tokens, cfg.train.group_size
    if prompt_len + n > geometry.row_len:
        raise ValueError(
            f"train.pack_length {geometry.row_len} is shorter than a prompt ({prompt_len}) "
            f"plus a completion at the budget ({n})"
        )
    per_row = 1 + (geometry.row_len - prompt_len - n) // n  # of one group, behind its prompt
    groups_rows = cfg.train.prompts_per_step * -(-g // per_row)
    rows = step_rows(groups_rows, geometry.row_multiple, geometry.rows_per_micro)
    micro = micro_steps(rows, geometry.rows_per_micro)
    return {
        "row_len": geometry.row_len,
        "rows": rows,
        "rows_per_micro_batch": rows // micro,
        "micro_batches": micro,
    }


def _lora_state(cfg: ExperimentConfig, mesh, tx, frozen, trainable: int, out) -> dict[str, Any]:
    """A LoRA train step's resident state per device beside full fine-tuning's of the same
    model and layout (parameters, their gradients, the optimizer state; from shapes: full
    fine-tuning keeps every parameter float32). Gradients have the trainable parameters'
    bytes; they are inside the compiled temporaries, counted here from the shapes."""
    lc = cfg.model.lora
    full_cfg = dataclasses.replace(cfg.model, lora=dataclasses.replace(
        lc, rank=0, base_dtype="float32", init_from=None))  # fmt: skip
    _, _, full = abstract_policy(dataclasses.replace(cfg, model=full_cfg))
    full = placed(full, mesh)
    full_params = tree_bytes(full)
    full_opt = tree_bytes(placed(jax.eval_shape(tx.init, full), mesh))
    # Resident: parameters, gradients, optimizer state (and GRPO's KL reference, a copy of
    # the trainable parameters).
    ref = 1 if cfg.loss.kl_coef else 0
    lora_total = out["parameters_bytes"] + (1 + ref) * trainable + out["optimizer_state_bytes"]
    full_total = (2 + ref) * full_params + full_opt
    return {
        "rank": lc.rank,
        "targets": list(lc.projections),
        "base_dtype": lc.base_dtype,
        "frozen_base_bytes": tree_bytes(frozen),
        "adapter_bytes": trainable,
        "parameters_bytes": out["parameters_bytes"],
        "gradient_bytes": trainable,
        "optimizer_state_bytes": out["optimizer_state_bytes"],
        "state_bytes": lora_total,
        "full_fine_tuning": {
            "parameters_bytes": full_params,
            "gradient_bytes": full_params,
            "optimizer_state_bytes": full_opt,
            "state_bytes": full_total,
        },
        "saving_bytes": full_total - lora_total,
    }
