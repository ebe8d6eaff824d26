"""The generator devices' plans: a decode chunk, the slot engine's admission or a wave's
prefill, and held-out evaluation, each with the copies of the weights in flight."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxrl_scale.generation.engine import abstract_slots, lower_admission
from jaxrl_scale.generation.sampler import Interruption, Sampling, decode, prefill
from jaxrl_scale.memory.abstract import (
    abstract_params,
    adapter_bytes,
    breakdown,
    narrowed_bytes,
    per_device_bytes,
    tree_bytes,
)
from jaxrl_scale.parallel import sharding
from jaxrl_scale.rl.generator import wave_prompts

if TYPE_CHECKING:  # the root config composes every part's section
    from jaxrl_scale.config import ExperimentConfig


def _interruption(cfg: ExperimentConfig) -> Interruption | None:
    """The config's forced interruption with placeholder token ids (only their count
    matters to memory)."""
    i = cfg.sampler.interruption
    if i is None:
        return None
    text = tuple(range(max(1, len(i.text) // 4)))
    return Interruption(text, i.think_min, i.think_max, i.answer_budget, (1,))


def _decode_chunk(cfg, graphdef, params, state, mesh, prompt_len: int, temperature: float):
    lowered = decode.lower(
        graphdef,
        params,
        state,
        0,
        max(cfg.sampler.chunk_size, 1),
        sampling=Sampling(temperature, 1.0, 0),
        eos_ids=(1,),
        pad_id=0,
        interruption=_interruption(cfg),
        prompt_len=prompt_len,
        mesh=mesh,
    )
    return breakdown(lowered.compile())


def _wave_prefill(cfg, graphdef, params, mesh, prompts: int, prompt_len: int, repeat: int):
    """The static path's prefill of one wave: `prompts` prompts (on every device, as
    `RolloutWorker.generate` places them) into `repeat` rows each."""
    where = sharding.batch_sharding(mesh) if repeat == 1 else sharding.replicated(mesh)
    shape = lambda dtype: jax.ShapeDtypeStruct((prompts, prompt_len), dtype, sharding=where)  # noqa: E731
    lowered = prefill.lower(
        graphdef,
        params,
        shape(np.int32),
        shape(np.bool_),
        jax.random.key(0),
        n_new=cfg.sampler.max_new_tokens,
        interruption=_interruption(cfg),
        mesh=mesh,
        repeat=repeat,
    )
    return breakdown(lowered.compile())


def generate_memory(
    cfg: ExperimentConfig,
    mesh,
    prompt_len: int,
    *,
    copy: bool = True,
    copies: int = 1,
    own_devices: bool = True,
) -> dict[str, Any]:
    """A decode chunk over the generator's slots: its per-device bytes (the parameters, the
    KV cache and the rows' buffers are arguments; the state is donated), plus `copies` - 1
    more copies of what each update places beside it (the parameters; with LoRA the adapters,
    on a base placed once). `copy`: the generator decodes with its own copy of the parameters
    (`rollout.decodes_with_copy`), in the dtypes of `model.for_generation`; else with the
    trainer's. `held_parameters_bytes`: the parameter bytes its devices hold beside what the
    train state holds (all of them on `own_devices`)."""
    graphdef, params = abstract_params(cfg, mesh, generation=copy)
    slots = cfg.sampler.slots or cfg.train.prompts_per_step * cfg.train.group_size
    state = abstract_slots(cfg.model, slots, prompt_len, cfg.sampler.max_new_tokens, mesh)
    out = _decode_chunk(cfg, graphdef, params, state, mesh, prompt_len, cfg.sampler.temperature)
    cache = state.cache
    out["kv_cache_bytes"] = sum(per_device_bytes(x) for x in jax.tree.leaves((cache.k, cache.v)))
    out["decode_state_bytes"] = tree_bytes(state)
    out["parameters_bytes"] = tree_bytes(params)
    out["parameter_copies"] = copies
    if cfg.model.lora.enabled:
        adapters = adapter_bytes(params)
        base = out["parameters_bytes"] - adapters
        out["base_bytes"], out["adapter_bytes"], out["update_bytes"] = base, adapters, adapters
        # Beside the trainer, the base is the trainer's own buffers but for those narrowed
        # to the compute dtype, and so are the adapters without a copy of their own.
        narrowed = cfg.model.dtype != "float32"
        held_base = base if own_devices else narrowed_bytes(cfg, mesh)
        held_adapters = copies * adapters if copy else (adapters if narrowed else 0)
        out["held_parameters_bytes"] = held_base + held_adapters
    else:
        out["update_bytes"] = out["parameters_bytes"]
        out["held_parameters_bytes"] = copies * out["parameters_bytes"] if copy else 0
    out["per_device_bytes"] += (copies - 1) * out["update_bytes"]
    out["slots"] = slots
    if cfg.batching == "continuous" and cfg.task.max_turns > 1:
        # Episodes waiting for their environments off a slot (rl/episodes.py): rows of
        # the slots' state that no program decodes, held beside them.
        parked = slots if cfg.sampler.parked_rows < 0 else cfg.sampler.parked_rows
        if parked:
            rows = abstract_slots(cfg.model, parked, prompt_len, cfg.sampler.max_new_tokens, mesh)
            out["parked_rows"], out["parked_rows_bytes"] = parked, tree_bytes(rows)
            out["per_device_bytes"] += out["parked_rows_bytes"]
    return out


def prefill_memory(cfg: ExperimentConfig, mesh, prompt_len: int, *, copy: bool) -> dict[str, Any]:
    """The program that starts rows: on the slot engine (`sampler.batching` continuous) its
    admission, the widest one a batch shard can see; on the static path the prefill of one
    wave. Its `extra_bytes`: what it holds beyond the parameters and the slots' state that
    the decode chunk holds too."""
    graphdef, params = abstract_params(cfg, mesh, generation=copy)
    g, n_new = cfg.train.group_size, cfg.sampler.max_new_tokens
    if cfg.batching == "continuous":
        slots = cfg.sampler.slots or cfg.train.prompts_per_step * g
        state = abstract_slots(cfg.model, slots, prompt_len, n_new, mesh)
        # Episodes on the engine (rl/episodes.py) are admitted one row per prompt.
        repeat = 1 if cfg.task.max_turns > 1 else g
        lowered = lower_admission(
            graphdef, params, state, repeat=repeat, prompt_len=prompt_len, n_new=n_new,
            interruption=_interruption(cfg), mesh=mesh,
        )  # fmt: skip
        out = breakdown(lowered.compile())
        out["program"] = "slot engine admission"
        out["extra_bytes"] = out["temporaries_bytes"] + out["outputs_bytes"]  # state donated
        return out
    prompts = wave_prompts(cfg, g, sharding.batch_ways(mesh), cfg.train.prompts_per_step)
    out = _wave_prefill(cfg, graphdef, params, mesh, prompts, prompt_len, g)
    out["program"] = f"prefill of a wave ({prompts} prompts x {g} rows)"
    out["extra_bytes"] = out["temporaries_bytes"]  # its output is the wave's decode state
    return out


def evaluate_memory(
    cfg: ExperimentConfig, mesh, prompt_len: int, *, copy: bool, own_copy: bool
) -> dict[str, Any]:
    """Held-out evaluation on the generator's devices: waves of the held-out prompts x
    train.eval_samples rows (`rollout.wave_prompts`), each prefilled and decoded to the end.
    Its total: the wave's decode state, the larger of its two programs' working memory and,
    with `own_copy`, the parameter copy it decodes with (beside those the generator holds;
    with LoRA, on the trainer's devices: adapters on the trainer's base)."""
    graphdef, params = abstract_params(cfg, mesh, generation=copy)
    k, n_new = cfg.train.eval_samples, cfg.sampler.max_new_tokens
    held_out = cfg.task.num_eval * max(1, len(cfg.task.mixture))  # a mixture: each domain's
    prompts = wave_prompts(cfg, k, sharding.batch_ways(mesh), held_out)
    first = _wave_prefill(cfg, graphdef, params, mesh, prompts, prompt_len, k)
    state = abstract_slots(cfg.model, prompts * k, prompt_len, n_new, mesh)
    temperature = cfg.train.eval_temperature
    chunk = _decode_chunk(cfg, graphdef, params, state, mesh, prompt_len, temperature)
    params_bytes = tree_bytes(params)
    if cfg.model.lora.enabled:  # its own copy: adapters on the base beside the train state
        params_bytes = adapter_bytes(params) + narrowed_bytes(cfg, mesh)
    state_bytes = tree_bytes(state)
    # Working memory: what each program holds beyond the parameters and the wave's state
    # (the prefill's output is that state; the decode chunk's is donated to it).
    working = max(first["temporaries_bytes"], chunk["temporaries_bytes"] + chunk["outputs_bytes"])
    out = {
        "rows_per_wave": prompts * k,
        "waves": -(-held_out // prompts),
        "decode_state_bytes": state_bytes,
        "working_bytes": working,
        "parameters_bytes": params_bytes if own_copy else 0,
        "prefill": first,
        "decode_chunk": chunk,
    }
    out["per_device_bytes"] = out["parameters_bytes"] + state_bytes + working
    return out


def generator_devices(report: dict[str, Any]) -> dict[str, Any]:
    """What the generator's devices hold at once (see `plan`); parameters the generator
    shares with the train state are counted with the train state."""
    gen, first, ev = report["generate"], report["prefill"], report["evaluate"]
    params = gen["held_parameters_bytes"]
    state = gen["decode_state_bytes"]
    decoding = gen["temporaries_bytes"] + gen["outputs_bytes"]  # the state is donated
    working = max(decoding, first["extra_bytes"])
    return {
        "parameters_bytes": params,
        "decode_state_bytes": state,
        "working_bytes": working,
        "working_program": first["program"] if first["extra_bytes"] > decoding else "decode",
        "evaluation_bytes": ev["per_device_bytes"],
        "per_device_bytes": params + state + working + ev["per_device_bytes"],
    }


def bound_evaluation(ev: dict[str, Any], float32_program: dict[str, Any]) -> None:
    """An evaluation plan's working memory: the smaller of its bf16 program as the CPU
    compiles it and the same evaluation in float32 (`float32_config`), both upper bounds."""
    ev["working_bytes_as_compiled"] = ev["working_bytes"]
    ev["working_bytes"] = min(ev["working_bytes"], float32_program["working_bytes"])
    ev["per_device_bytes"] = ev["parameters_bytes"] + ev["decode_state_bytes"] + ev["working_bytes"]


def float32_config(cfg: ExperimentConfig) -> ExperimentConfig | None:
    """The config whose programs are the second upper bound on a CPU (None where there is
    none: another backend, or a float32 model). The CPU compiler has no bf16 matmuls: it
    converts their operands (every layer's weights, the whole KV cache) to float32 copies
    that an accelerator never makes. The same program in float32 has no such copies and
    activations twice as wide. (A bfloat16 LoRA base is widened with it, or its kernels would
    be cast to float32 copies there.)"""
    if jax.default_backend() != "cpu" or cfg.model.dtype == "float32":
        return None
    m = cfg.model
    lora = dataclasses.replace(m.lora, base_dtype="float32")
    return dataclasses.replace(cfg, model=dataclasses.replace(m, dtype="float32", lora=lora))


def bound_temporaries(part: dict[str, Any], float32_program: int) -> None:
    as_compiled = part["temporaries_bytes"]
    part["temporaries_bytes_as_compiled"] = as_compiled
    part["temporaries_bytes_float32_program"] = float32_program
    part["temporaries_bytes"] = min(as_compiled, float32_program)
    part["per_device_bytes"] += part["temporaries_bytes"] - as_compiled
