"""Will a config fit? Compile every program a run puts on each device (the train step; the
generator's decode chunk, admission or prefill, and held-out evaluation) from abstract shapes
and read XLA's memory analysis, per device, before anything is allocated.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        jaxrl-scale memory --config configs/scalerl_qwen3-8b_math.yaml --device-memory 80

Nothing here touches real weights or data: the model, optimizer state and batches are
ShapeDtypeStructs carrying the shardings the run would give them, so a laptop with fake CPU
devices plans a pod's run. The numbers are what XLA's compiler reserves for one device on the
platform it compiled for (the CPU compiler's buffer assignment when run on fake devices: the
same shapes and shardings as on an accelerator, though fusion and scheduling differ, so treat
a margin of 10-15% as noise). Under `model.attention: auto` the CPU compiles the blockwise
attention where a GPU runs cuDNN and a TPU the splash kernel; the report names the program
it compiled, and only a plan run on the accelerator compiles the accelerator's own. Likewise
a mixture of experts' grouped matmul (ragged_dot, which the CPU lowers to dense matmuls over
masked copies) is planned on CPUs by `moe.experts_scan`, the same buffers one tile at a time.

A verdict compares what one device holds at once with the memory pool JAX gets there: on a
GPU, XLA_PYTHON_CLIENT_MEM_FRACTION of the device (JAX preallocates 0.75 unless it is set;
the launchers set it), on a TPU the whole device (`--mem-fraction 1`).

On CPU a bf16 program's temporaries hold float32 copies of every bf16 matmul operand (the CPU
has no bf16 matmuls; for a decode chunk that is every layer's weights and the whole KV cache,
at twice their bytes: measured, 1.78 GiB per Qwen3-8B layer at 64 slots x 17k tokens). An
accelerator makes no such copies, so for a bf16 config the CPU also compiles the float32
program (no copies, activations twice as wide) and reports the smaller of the two
temporaries, each an upper bound; both stay in the report.

With LoRA (`model.lora.rank` > 0) the plan holds what such a run holds (lora.py): the train
step's arguments are the frozen base (in `model.lora.base_dtype`, never donated) beside a
train state of the adapters alone, whose gradients and optimizer moments are the adapters';
the generator keeps one copy of the base in its decoding dtypes and receives only adapters,
so its copies in flight are adapter copies. The report adds what full fine-tuning of the
same model would hold per device (parameters, gradients and Adam's moments in float32, from
the same shapes and layout) beside LoRA's.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxrl_scale.config import ExperimentConfig
from jaxrl_scale.generation.engine import abstract_slots, lower_admission
from jaxrl_scale.generation.sampler import Interruption, Sampling, decode, prefill
from jaxrl_scale.models import attention, lora, moe
from jaxrl_scale.models.hf import config_from_hf, resolve_checkpoint
from jaxrl_scale.models.peft import resolve_lora
from jaxrl_scale.models.policy import Policy, for_generation
from jaxrl_scale.parallel import sharding
from jaxrl_scale.rl.generator import wave_prompts
from jaxrl_scale.rl.packing import PackedBatch, PackGeometry, bucket_rows
from jaxrl_scale.rl.rollout import decodes_with_copy
from jaxrl_scale.rl.step import Batch, TrainState, compile_run_step, make_optimizer

GIB = 2**30
DEFAULT_PROMPT_LEN = 1024  # tokens of a math prompt when --prompt-len does not say
# The share of a GPU's memory JAX takes for its pool when XLA_PYTHON_CLIENT_MEM_FRACTION is
# not set (it preallocates it at start-up): what a plan compares with on a GPU.
JAX_GPU_MEM_FRACTION = 0.75


def task_prompt_len(cfg: ExperimentConfig) -> tuple[int, str]:
    """(prompt slots, where the number comes from). A procedural task's prompts are generated
    and measured (padded to a multiple of 8, as the sampler pads); a dataset's are not read."""
    if cfg.task.name == "math":
        return DEFAULT_PROMPT_LEN, "default for math; set --prompt-len"
    from jaxrl_scale.tasks import make_task

    task = make_task(cfg.task, seed=cfg.seed)
    examples = task.train_examples + task.eval_examples
    longest = max(len(task.tokenizer.encode(e["prompt"])) for e in examples)
    return -(-longest // 8) * 8, f"the longest of {len(examples)} {cfg.task.name} prompts"


def resolve_model(cfg: ExperimentConfig) -> ExperimentConfig:
    """With model.init_from, the architecture its config.json fixes (as training would load it);
    with model.lora.init_from, the rank and targets of that PEFT adapter's config (as
    `train.setup` takes them). The weights are not read."""
    if cfg.model.lora.init_from:
        lora_cfg = resolve_lora(cfg.model.lora)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=lora_cfg))
    if not cfg.model.init_from:
        return cfg
    folder = resolve_checkpoint(cfg.model.init_from)
    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"model.init_from: cannot read {folder / 'config.json'} ({e})") from None
    model = config_from_hf(hf, **cfg.model.runtime_fields())
    model = dataclasses.replace(model, init_from=cfg.model.init_from)
    return dataclasses.replace(cfg, model=model)


def _placed(state, mesh):
    """ShapeDtypeStructs of an abstract State placed by their variables' logical axes (other
    leaves replicated), as the run's arrays would be."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        state,
        sharding.state_shardings(state, mesh),
    )


def _abstract_policy(cfg: ExperimentConfig):
    """(graphdef, frozen base or None, trainable parameters) as a run splits its policy
    (`lora.split_policy`: with LoRA the base in `model.lora.base_dtype` and the adapters;
    without, None and every parameter), as unplaced ShapeDtypeStructs."""
    return nnx.eval_shape(lambda: lora.split_policy(Policy(cfg.model, rngs=nnx.Rngs(0)), cfg.model))


def _abstract_params(cfg: ExperimentConfig, mesh, *, generation: bool = False):
    """(graphdef, parameters as ShapeDtypeStructs sharded by their logical axes on `mesh`);
    with `generation`, the dtypes the generator decodes with (`model.for_generation`). A LoRA
    generator always decodes in those (`RolloutWorker`), the base's and the adapters' alike."""
    graphdef, frozen, params = _abstract_policy(cfg)
    state = lora.merge_params(frozen, params)
    if generation or frozen is not None:
        state = jax.eval_shape(lambda s: for_generation(s, cfg.model, copy=False), state)
    return graphdef, _placed(state, mesh)


def _adapter_bytes(state, *, per_device: bool = True) -> int:
    """Bytes of the LoRA adapters in a placed abstract state (0 without LoRA): one device's
    shards, or with `per_device` False the whole arrays."""
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    size = _per_device_bytes if per_device else lambda x: x.size * np.dtype(x.dtype).itemsize
    return sum(size(v.get_value()) for v in variables if isinstance(v, lora.LoRAParam))


def _narrowed_bytes(cfg: ExperimentConfig, mesh) -> int:
    """Per-device bytes of the new buffers a LoRA generator sharing the trainer's devices
    makes of the frozen base (`for_generation` without a copy: the leaves it narrows to the
    compute dtype, e.g. an untied embedding; the rest are the trainer's own buffers)."""
    _, frozen, _ = _abstract_policy(cfg)
    wide = _placed(frozen, mesh)
    narrow = _placed(
        jax.eval_shape(lambda s: for_generation(s, cfg.model, copy=False), frozen), mesh
    )
    return sum(
        _per_device_bytes(n)
        for w, n in zip(jax.tree.leaves(wide), jax.tree.leaves(narrow), strict=True)
        if n.dtype != w.dtype
    )


def _breakdown(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    args, out, alias, temp = (
        int(m.argument_size_in_bytes),
        int(m.output_size_in_bytes),
        int(m.alias_size_in_bytes),
        int(m.temp_size_in_bytes),
    )
    return {
        "arguments_bytes": args,
        "temporaries_bytes": temp,
        "outputs_bytes": out - alias,  # outputs that do not reuse a donated argument's buffer
        "per_device_bytes": args + temp + out - alias,
    }


def train_step_memory(cfg: ExperimentConfig, mesh, prompt_len: int) -> dict[str, Any]:
    """The compiled train step's per-device bytes: arguments (parameters, optimizer state, the
    batch), temporaries (activations, gradients, the update), outputs not aliased. With LoRA
    the parameters are the frozen base (an argument of its own, not donated) and the adapters,
    the optimizer state is the adapters' alone, and `lora` compares with full fine-tuning."""
    graphdef, frozen, params = _abstract_policy(cfg)
    params = _placed(params, mesh)
    tx = make_optimizer(cfg.optim, total_steps=cfg.train.steps)
    scalar = jax.ShapeDtypeStruct((), np.int32, sharding=sharding.replicated(mesh))
    state = TrainState(
        params=params,
        # The moments are parameter-shaped States: their logical axes place them.
        opt_state=_placed(jax.eval_shape(tx.init, params), mesh),
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
        frozen = _placed(frozen, mesh)
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
            rows_per_micro=None if packed is None else packed["rows_per_micro_batch"],
        )  # fmt: skip
        out = _breakdown(step.lower(*args).compile())
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
    trainable = _state_bytes(state.params)
    out["parameters_bytes"] = trainable + (0 if frozen is None else _state_bytes(frozen))
    out["optimizer_state_bytes"] = _state_bytes(state.opt_state)
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
    rows = bucket_rows(groups_rows, geometry.row_multiple)
    per_micro = geometry.rows_per_micro or rows // cfg.train.micro_batches
    return {
        "row_len": geometry.row_len,
        "rows": rows,
        "rows_per_micro_batch": per_micro,
        "micro_batches": rows // per_micro,
    }


def _lora_state(cfg: ExperimentConfig, mesh, tx, frozen, trainable: int, out) -> dict[str, Any]:
    """A LoRA train step's resident state per device beside full fine-tuning's of the same
    model and layout (parameters, their gradients, the optimizer state; from shapes: full
    fine-tuning keeps every parameter float32). Gradients have the trainable parameters'
    bytes; they are inside the compiled temporaries, counted here from the shapes."""
    lc = cfg.model.lora
    full_cfg = dataclasses.replace(cfg.model, lora=dataclasses.replace(
        lc, rank=0, base_dtype="float32", init_from=None))  # fmt: skip
    _, _, full = _abstract_policy(dataclasses.replace(cfg, model=full_cfg))
    full = _placed(full, mesh)
    full_params = _state_bytes(full)
    full_opt = _state_bytes(_placed(jax.eval_shape(tx.init, full), mesh))
    # Resident: parameters, gradients, optimizer state (and GRPO's KL reference, a copy of
    # the trainable parameters).
    ref = 1 if cfg.loss.kl_coef else 0
    lora_total = out["parameters_bytes"] + (1 + ref) * trainable + out["optimizer_state_bytes"]
    full_total = (2 + ref) * full_params + full_opt
    return {
        "rank": lc.rank,
        "targets": list(lc.projections),
        "base_dtype": lc.base_dtype,
        "frozen_base_bytes": _state_bytes(frozen),
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
    return _breakdown(lowered.compile())


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
    return _breakdown(lowered.compile())


def _state_bytes(state) -> int:
    return sum(_per_device_bytes(x) for x in jax.tree.leaves(state))


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
    graphdef, params = _abstract_params(cfg, mesh, generation=copy)
    slots = cfg.sampler.slots or cfg.train.prompts_per_step * cfg.train.group_size
    state = abstract_slots(cfg.model, slots, prompt_len, cfg.sampler.max_new_tokens, mesh)
    out = _decode_chunk(cfg, graphdef, params, state, mesh, prompt_len, cfg.sampler.temperature)
    cache = state.cache
    out["kv_cache_bytes"] = sum(_per_device_bytes(x) for x in jax.tree.leaves((cache.k, cache.v)))
    out["decode_state_bytes"] = _state_bytes(state)
    out["parameters_bytes"] = _state_bytes(params)
    out["parameter_copies"] = copies
    if cfg.model.lora.enabled:
        adapters = _adapter_bytes(params)
        base = out["parameters_bytes"] - adapters
        out["base_bytes"], out["adapter_bytes"], out["update_bytes"] = base, adapters, adapters
        # Beside the trainer, the base is the trainer's own buffers but for those narrowed
        # to the compute dtype, and so are the adapters without a copy of their own.
        narrowed = cfg.model.dtype != "float32"
        held_base = base if own_devices else _narrowed_bytes(cfg, mesh)
        held_adapters = copies * adapters if copy else (adapters if narrowed else 0)
        out["held_parameters_bytes"] = held_base + held_adapters
    else:
        out["update_bytes"] = out["parameters_bytes"]
        out["held_parameters_bytes"] = copies * out["parameters_bytes"] if copy else 0
    out["per_device_bytes"] += (copies - 1) * out["update_bytes"]
    out["slots"] = slots
    return out


def prefill_memory(cfg: ExperimentConfig, mesh, prompt_len: int, *, copy: bool) -> dict[str, Any]:
    """The program that starts rows: on the slot engine (`sampler.batching` continuous) its
    admission, the widest one a batch shard can see; on the static path the prefill of one
    wave. Its `extra_bytes`: what it holds beyond the parameters and the slots' state that
    the decode chunk holds too."""
    graphdef, params = _abstract_params(cfg, mesh, generation=copy)
    g, n_new = cfg.train.group_size, cfg.sampler.max_new_tokens
    if cfg.batching == "continuous":
        slots = cfg.sampler.slots or cfg.train.prompts_per_step * g
        state = abstract_slots(cfg.model, slots, prompt_len, n_new, mesh)
        lowered = lower_admission(
            graphdef, params, state, repeat=g, prompt_len=prompt_len, n_new=n_new,
            interruption=_interruption(cfg), mesh=mesh,
        )  # fmt: skip
        out = _breakdown(lowered.compile())
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
    """Held-out evaluation on the generator's devices: waves of task.num_eval prompts x
    train.eval_samples rows (`rollout.wave_prompts`), each prefilled and decoded to the end.
    Its total: the wave's decode state, the larger of its two programs' working memory and,
    with `own_copy`, the parameter copy it decodes with (beside those the generator holds;
    with LoRA, on the trainer's devices: adapters on the trainer's base)."""
    graphdef, params = _abstract_params(cfg, mesh, generation=copy)
    k, n_new = cfg.train.eval_samples, cfg.sampler.max_new_tokens
    prompts = wave_prompts(cfg, k, sharding.batch_ways(mesh), cfg.task.num_eval)
    first = _wave_prefill(cfg, graphdef, params, mesh, prompts, prompt_len, k)
    state = abstract_slots(cfg.model, prompts * k, prompt_len, n_new, mesh)
    temperature = cfg.train.eval_temperature
    chunk = _decode_chunk(cfg, graphdef, params, state, mesh, prompt_len, temperature)
    params_bytes = _state_bytes(params)
    if cfg.model.lora.enabled:  # its own copy: adapters on the base beside the train state
        params_bytes = _adapter_bytes(params) + _narrowed_bytes(cfg, mesh)
    state_bytes = _state_bytes(state)
    # Working memory: what each program holds beyond the parameters and the wave's state
    # (the prefill's output is that state; the decode chunk's is donated to it).
    working = max(first["temporaries_bytes"], chunk["temporaries_bytes"] + chunk["outputs_bytes"])
    out = {
        "rows_per_wave": prompts * k,
        "waves": -(-cfg.task.num_eval // prompts),
        "decode_state_bytes": state_bytes,
        "working_bytes": working,
        "parameters_bytes": params_bytes if own_copy else 0,
        "prefill": first,
        "decode_chunk": chunk,
    }
    out["per_device_bytes"] = out["parameters_bytes"] + state_bytes + working
    return out


def _per_device_bytes(x) -> int:
    shard = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return int(np.prod(shard)) * 8  # a threefry key: two uint32
    return int(np.prod(shard)) * np.dtype(x.dtype).itemsize


def plan(
    cfg: ExperimentConfig,
    *,
    prompt_len: int | None = None,
    device_memory_gib: float | None = None,
    mem_fraction: float | None = None,
) -> dict[str, Any]:
    """Every program's per-device bytes on the config's meshes, what each set of devices
    holds at once, whether that fits the memory pool (`device_memory_gib` x `mem_fraction`,
    when given), and for what does not, its biggest term and the settings that shrink it.

    The generator's devices hold, at once: its parameter copies, the slots' decode state,
    the working memory of whichever of its programs runs (a decode chunk, or the admission /
    prefill that starts rows), and a held-out evaluation (its waves are decoded beside the
    generator, which keeps its slots; in threaded pipeline_rl the two run concurrently, so
    the plan always adds them, an upper bound elsewhere)."""
    source = "--prompt-len"
    if prompt_len is None:
        prompt_len, source = task_prompt_len(cfg)
    if prompt_len < 1:
        raise ValueError(f"prompt length must be >= 1, got {prompt_len}")
    if mem_fraction is not None and not 0 < mem_fraction <= 1:
        raise ValueError(f"--mem-fraction must be in (0, 1], got {mem_fraction}")
    attention_note = _attention_program(cfg, prompt_len)
    if jax.default_backend() == "cpu" and cfg.model.attention in ("cudnn", "splash"):
        # The fused kernels do not compile for CPU (splash only interpreted): the blockwise
        # attention, whose memory is linear in T as theirs is, stands in for them.
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="blockwise"))
    planned, experts_note = _experts_program(cfg)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_matmul=planned))
    mesh, gen_mesh = sharding.make_meshes(cfg)
    if cfg.hosts.generator_groups:  # each group's own mesh, planned on devices like theirs
        gen_mesh = _group_mesh(cfg)  # (a generator job decodes in static waves)
        cfg = dataclasses.replace(cfg, sampler=dataclasses.replace(cfg.sampler, batching="static"))
    sharding.check_divisible(cfg, mesh, gen_mesh)
    gmesh = gen_mesh or mesh
    copy = decodes_with_copy(cfg, gen_mesh)
    # A copy of its own: new weights are placed while the generator may still decode with
    # the ones it has (pipeline_rl), or while the source still holds them (every mode), so
    # two copies sit on its devices; never three (`pipeline.ParamsSource`).
    copies = 2 if copy else 1
    own_devices = gen_mesh is not None
    # Evaluation after a step decodes with the generator's newest copy, that step's (the
    # first, before the generator starts, makes one of its own): no copy beside them.
    own_copy = False

    def programs(cfg):
        return {
            "train_step": train_step_memory(cfg, mesh, prompt_len),
            "generate": generate_memory(
                cfg, gmesh, prompt_len, copy=copy, copies=copies, own_devices=own_devices
            ),
            "prefill": prefill_memory(cfg, gmesh, prompt_len, copy=copy),
            "evaluate": evaluate_memory(cfg, gmesh, prompt_len, copy=copy, own_copy=own_copy),
        }

    report = {
        "sequence_length": prompt_len + cfg.sampler.max_new_tokens,
        "prompt_len": prompt_len,
        "prompt_len_from": source,
        "max_new_tokens": cfg.sampler.max_new_tokens,
        "train_mesh": dict(mesh.shape),
        "generate_mesh": dict(gmesh.shape),
        "attention": attention_note,
        **({"experts": experts_note} if experts_note else {}),
        **programs(cfg),
    }
    if jax.default_backend() == "cpu" and cfg.model.dtype != "float32":
        # The CPU compiler has no bf16 matmuls: it converts their operands (every layer's
        # weights, the whole KV cache) to float32 copies that an accelerator never makes. The
        # same program in float32 has no such copies and activations twice as wide: its
        # temporaries are a second upper bound. Report the smaller one. (A bfloat16 LoRA
        # base is widened with it, or its kernels would be cast to float32 copies there.)
        m = cfg.model
        lora_f32 = dataclasses.replace(m.lora, base_dtype="float32")
        wide = programs(
            dataclasses.replace(cfg, model=dataclasses.replace(m, dtype="float32", lora=lora_f32))
        )
        for name in ("train_step", "generate", "prefill"):
            _bound_temporaries(report[name], wide[name]["temporaries_bytes"])
        report["prefill"]["extra_bytes"] = min(
            report["prefill"]["extra_bytes"], wide["prefill"]["extra_bytes"]
        )
        ev, wide_ev = report["evaluate"], wide["evaluate"]
        ev["working_bytes_as_compiled"] = ev["working_bytes"]
        ev["working_bytes"] = min(ev["working_bytes"], wide_ev["working_bytes"])
        ev["per_device_bytes"] = (
            ev["parameters_bytes"] + ev["decode_state_bytes"] + ev["working_bytes"]
        )
    report["generator"] = _generator_devices(report)
    names = ["train_step", "generator"]
    if cfg.hosts.generator_groups:
        _plan_hosts(report, cfg, mesh, prompt_len)
        names = ["trainer_host", "generator"]
    elif gen_mesh is None:
        # One set of devices: the train state stays while the generator works (pipeline_rl:
        # the train step runs at once too).
        train = report["train_step"]
        if cfg.pipeline.mode == "pipeline_rl":
            both = train["per_device_bytes"]
        else:
            both = train["parameters_bytes"] + train["optimizer_state_bytes"]
        report["train_and_generate"] = {
            "per_device_bytes": both + report["generator"]["per_device_bytes"],
            "concurrent": cfg.pipeline.mode == "pipeline_rl",
        }
        names = ["train_step", "train_and_generate"]
    if device_memory_gib is not None:
        fraction = mem_fraction if mem_fraction is not None else default_mem_fraction()
        pool = int(device_memory_gib * fraction * GIB)
        report["device_memory_bytes"] = int(device_memory_gib * GIB)
        report["mem_fraction"] = fraction
        report["pool_bytes"] = pool
        for name in names:
            part = report[name]
            part["fits"] = part["per_device_bytes"] <= pool
            if not part["fits"]:
                part["advice"] = _advice(name, part, cfg, report)
        report["fits"] = all(report[name]["fits"] for name in names)
    return report


def _group_mesh(cfg: ExperimentConfig):
    """A generator group's mesh (`hosts.generator_mesh`, -1: all devices here), on this
    machine's devices: the plan of one group's hosts."""
    m = cfg.hosts.generator_mesh
    sizes = [m.data, m.fsdp, m.expert, m.tensor]
    fixed = int(np.prod([x for x in sizes if x != -1]))
    n = fixed * (len(jax.devices()) // fixed) if -1 in sizes else fixed
    if n > len(jax.devices()) or n < 1:
        raise ValueError(f"hosts.generator_mesh needs {n} devices; {len(jax.devices())} here")
    return sharding.make_mesh(m, jax.devices()[:n])


def _plan_hosts(report: dict[str, Any], cfg: ExperimentConfig, mesh, prompt_len: int) -> None:
    """Generators are jobs of their own: their devices hold two copies (the one decoding and
    the version being received) and no evaluation (the trainer evaluates); the trainer's hold
    the train step, and beside the train state the versions its weight server keeps laid out
    for the generators (`weights.WeightServer`: 2, each split over all trainer devices), and
    between steps a held-out evaluation with a copy of its own. With LoRA a version is its
    adapters."""
    gen = report["generator"]
    gen["per_device_bytes"] -= gen["evaluation_bytes"]
    gen["evaluation_bytes"] = 0
    _, params = _abstract_params(cfg, mesh, generation=True)
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    if cfg.model.lora.enabled:  # a version is its adapters (the generators hold the base)
        total = _adapter_bytes(params, per_device=False)
    held = 2 * -(-total // mesh.devices.size)
    train = report["train_step"]
    evaluation = evaluate_memory(cfg, mesh, prompt_len, copy=True, own_copy=True)
    resident = train["parameters_bytes"] + train["optimizer_state_bytes"]
    report["trainer_host"] = {
        "train_step_bytes": train["per_device_bytes"],
        "held_versions_bytes": held,
        "evaluation_bytes": evaluation["per_device_bytes"],
        "per_device_bytes": held + max(train["per_device_bytes"],
                                       resident + evaluation["per_device_bytes"]),
    }  # fmt: skip


def default_mem_fraction() -> float:
    """The share of a device's memory JAX's pool gets: XLA_PYTHON_CLIENT_MEM_FRACTION where
    set, else JAX's GPU default; planned on a TPU, the whole device (a TPU plan made
    elsewhere passes `--mem-fraction 1`)."""
    import os

    value = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if not value:
        return 1.0 if jax.default_backend() == "tpu" else JAX_GPU_MEM_FRACTION
    try:
        fraction = float(value)
    except ValueError:
        raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={value!r} is not a number") from None
    if not 0 < fraction <= 1:
        raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={value} must be in (0, 1]")
    return fraction


def _attention_program(cfg: ExperimentConfig, prompt_len: int) -> str:
    """Which attention the plan's train step compiles, on this platform, and what it stands
    for: under `auto` an accelerator runs its own kernel, planned only when compiled there."""
    t = prompt_len + cfg.sampler.max_new_tokens
    m = cfg.model
    platform = jax.default_backend()
    wanted = m.attention
    if platform == "cpu" and wanted in ("cudnn", "splash"):
        return f"{wanted} estimated as blockwise on CPU"
    compiled = attention.resolve(
        wanted, queries=t, keys=t, block_size=m.attention_block_size, dtype=m.dtype,
        query_offset=0, head_dim=m.resolved_head_dim,
    )  # fmt: skip
    if wanted != "auto":
        return f"{compiled} (model.attention: {wanted}) on {platform}"
    if compiled == "xla":
        return "auto compiled as xla: every key fits one block, the same on every platform"
    if platform == "cpu":
        return (
            f"auto compiled as {compiled} on cpu: a GPU runs cudnn (half-precision "
            "self-attention) and a TPU splash instead, whose memory is linear in T as "
            "blockwise's is; run the plan on the accelerator to plan its own program"
        )
    return f"auto compiled as {compiled} on {platform}: the program this platform runs"


def _experts_program(cfg: ExperimentConfig) -> tuple[str, str | None]:
    """(the `model.moe_matmul` the plan compiles, what the report says of it: None without
    experts). On CPUs the grouped matmul an accelerator runs (ragged) is planned by its
    sequential form of the same buffers (`moe.experts_scan`): ragged_dot lowers there to
    dense matmuls over masked copies, E times a grouped matmul's buffers."""
    m = cfg.model
    platform = jax.default_backend()
    if platform == "cpu" and m.moe_matmul in ("auto", "ragged"):
        note = (
            f"{m.moe_matmul} planned as scan on cpu: the grouped matmul's buffers (a GPU or "
            "TPU runs ragged_dot, which the CPU lowers to dense matmuls over masked copies)"
        )
        return "scan", note if m.num_experts else None
    compiled = moe.resolve_matmul(m.moe_matmul)
    note = f"{compiled} (model.moe_matmul: {m.moe_matmul}) on {platform}"
    return m.moe_matmul, note if m.num_experts else None


def _generator_devices(report: dict[str, Any]) -> dict[str, Any]:
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


def _bound_temporaries(part: dict[str, Any], float32_program: int) -> None:
    as_compiled = part["temporaries_bytes"]
    part["temporaries_bytes_as_compiled"] = as_compiled
    part["temporaries_bytes_float32_program"] = float32_program
    part["temporaries_bytes"] = min(as_compiled, float32_program)
    part["per_device_bytes"] += part["temporaries_bytes"] - as_compiled


def _advice(name: str, part: dict[str, Any], cfg: ExperimentConfig, report) -> str:
    m = cfg.model
    packed = "packed" in report["train_step"]  # train.packing: true, or auto always packing
    micro = "train.tokens_per_micro_batch" if packed else "train.micro_batches"
    if name == "train_and_generate":
        run = "run at once" if part["concurrent"] else "keep the train state while generating"
        return (
            f"the train step and the generator share these devices and {run}: give the "
            "generator its own (pipeline.generator_devices), or shrink either side "
            f"(generator: {_generator_advice(report['generator'], report, cfg)}; train step: "
            f"{micro}, model.remat)"
        )
    if name == "generator":
        return _generator_advice(part, report, cfg)
    if name == "trainer_host":
        return (
            "the train step and the versions kept for the generators do not fit: more trainer "
            f"devices (mesh.fsdp), {micro}, model.remat"
        )
    state = part["parameters_bytes"] + part["optimizer_state_bytes"]
    if state >= part["temporaries_bytes"]:
        if not m.lora.enabled:
            also = "or train low-rank adapters alone (model.lora.rank)"
        elif m.lora.base_dtype == "float32":
            also = "or keep the frozen base in bfloat16 (model.lora.base_dtype)"
        else:
            also = "or a smaller model"
        return (
            f"parameters + optimizer state ({_gib(state)} per device) are the biggest term: "
            f"shard them over more devices (mesh.fsdp, now {cfg.mesh.fsdp}) {also}"
        )
    if "packed" in part:
        knobs = [_packed_budget(part, report)]
    else:
        knobs = [f"more train.micro_batches (now {cfg.train.micro_batches})"]
        if part.get("auto_padded"):
            knobs.append(
                "train.tokens_per_micro_batch below "
                f"{part['positions_per_micro_batch_per_shard']:,} (packing: auto then always "
                "packs, in micro-steps of that many positions)"
            )
    if m.remat != "full" or not m.scan_layers:
        # Measured: remat pays off inside the scanned layers (each layer one checkpoint).
        knobs.append(
            f"model.remat=full with model.scan_layers=true (now {m.remat}, {m.scan_layers})"
        )
    if m.attention == "xla":
        knobs.append("model.attention=auto (stored scores grow as T^2)")
    knobs.append(f"a smaller model.logits_chunk_size (now {m.logits_chunk_size})")
    return (
        f"temporaries (activations and gradients, {_gib(part['temporaries_bytes'])} per device, "
        f"{part['rows_per_micro_batch']} rows per micro-batch) are the biggest term; what "
        "shrinks them: " + ", ".join(knobs)
    )


def _packed_budget(part: dict[str, Any], report) -> str:
    """A packed step's token budget that would fit: the temporaries scaled with the positions
    per micro-step (about linear; the parameters and optimizer state stay)."""
    now = part["positions_per_micro_batch_per_shard"]
    room = report["pool_bytes"] - (part["per_device_bytes"] - part["temporaries_bytes"])
    row = part["packed"]["row_len"]
    fits = now * room // max(part["temporaries_bytes"], 1) // row * row
    if fits < row:
        return (
            f"not even one packed row of {row:,} per micro-step fits beside the state: a "
            "shorter train.pack_length or less state per device"
        )
    return (
        f"a smaller train.tokens_per_micro_batch (now {now:,} positions per batch shard per "
        f"micro-step; about {fits:,} would fit, the temporaries scaled with the positions)"
    )


def _generator_advice(part: dict[str, Any], report, cfg: ExperimentConfig) -> str:
    """The generator devices' biggest term and what shrinks it."""
    ev, gen = report["evaluate"], report["generate"]
    terms = {
        "parameter copies": part["parameters_bytes"],
        "decode state": part["decode_state_bytes"],
        "working memory": part["working_bytes"],
        "evaluation": part["evaluation_bytes"],
    }
    biggest = max(terms, key=terms.get)
    size = _gib(terms[biggest])
    if biggest == "evaluation":
        return (
            f"held-out evaluation ({size}: {ev['rows_per_wave']} rows per wave) is the biggest "
            f"term: fewer rows per wave (sampler.slots, now {cfg.sampler.slots}, bounds a wave; "
            f"train.eval_samples, now {cfg.train.eval_samples}) or more generator devices"
        )
    if biggest == "parameter copies":
        return (
            f"the parameter copies ({size}, {gen['parameter_copies']} of them) are the biggest "
            "term: split the generator's weights (mesh.tensor) or use a bf16 model.dtype"
        )
    return (
        f"the {biggest} ({size}; the KV cache of {gen['slots']} slots is "
        f"{_gib(gen['kv_cache_bytes'])}) is the biggest term: fewer rows in flight "
        f"(sampler.slots, now {cfg.sampler.slots or gen['slots']}) or more generator devices "
        "(pipeline.generator_devices, or a larger batch axis of the mesh)"
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def format_plan(report: dict[str, Any]) -> str:
    lines = [
        f"sequence length {report['sequence_length']:,} tokens "
        f"(prompt {report['prompt_len']:,} [{report['prompt_len_from']}] + max_new_tokens "
        f"{report['max_new_tokens']:,})",
        f"attention: {report['attention']}",
    ]
    if "experts" in report:
        lines.append(f"experts: {report['experts']}")
    titles = {
        "train_step": ("train step", report["train_mesh"]),
        "generate": ("generate (one decode chunk)", report["generate_mesh"]),
    }
    for name, (title, mesh) in titles.items():
        part = report[name]
        axes = " ".join(f"{k}={v}" for k, v in mesh.items())
        lines.append(f"\n{title}, mesh {axes}, per device:")
        rows = [("parameters", part["parameters_bytes"])]
        if "lora" in part:
            adapted = part["lora"]
            rows += [
                (f"  frozen base ({adapted['base_dtype']})", adapted["frozen_base_bytes"]),
                ("  adapters (float32)", adapted["adapter_bytes"]),
            ]
        elif "adapter_bytes" in part:
            rows += [("  base", part["base_bytes"]), ("  adapters", part["adapter_bytes"])]
        if part.get("parameter_copies", 1) > 1:
            n = part["parameter_copies"]
            what = "adapters" if "adapter_bytes" in part else "weights"
            rows.append((f"  x{n}: {what} in flight", n * part["update_bytes"]))
        if name == "train_step":
            rows += [
                ("optimizer state", part["optimizer_state_bytes"]),
                ("all arguments (+ batch)", part["arguments_bytes"]),
            ]
        else:
            rows += [
                ("KV cache", part["kv_cache_bytes"]),
                ("all arguments (+ rows)", part["arguments_bytes"]),
            ]
        rows += [
            ("temporaries", part["temporaries_bytes"]),
            ("outputs (not aliased)", part["outputs_bytes"]),
            ("total", part["per_device_bytes"]),
        ]
        lines += _table(rows)
        if "packed" in part:
            pk, per_shard = part["packed"], part["positions_per_micro_batch_per_shard"]
            lines.append(
                f"  packed (train.packing): {pk['rows']} rows of {pk['row_len']:,} (every "
                f"completion at the budget), {pk['micro_batches']} micro-step"
                f"{'s' if pk['micro_batches'] != 1 else ''} of "
                f"{pk['rows_per_micro_batch']} rows, {per_shard:,} positions per batch shard each"
            )
        if part.get("auto_padded"):
            lines.append(
                "  train.packing: auto, planned padded: the layout auto takes for a batch whose "
                "completions all run to the budget"
            )
        if "temporaries_bytes_as_compiled" in part:
            lines.append(
                "  temporaries: the smaller of two upper bounds, bf16 as the CPU compiles it "
                f"({_gib(part['temporaries_bytes_as_compiled'])}, float32 copies of matmul "
                f"operands) and the float32 program "
                f"({_gib(part['temporaries_bytes_float32_program'])})"
            )
    if "lora" in report["train_step"]:
        lines += _lora_lines(report["train_step"]["lora"])
    first, ev, gen = report["prefill"], report["evaluate"], report["generator"]
    lines.append(f"\n{first['program']}: {_gib(first['extra_bytes'])} per device beyond the "
                 "parameters and the slots' state")  # fmt: skip
    lines.append(
        f"held-out evaluation: {ev['waves']} wave(s) of {ev['rows_per_wave']} rows, "
        f"{_gib(ev['per_device_bytes'])} per device beside the generator"
    )
    lines.append("\nthe generator's devices hold at once, per device:")
    lines += _table([
        ("parameter copies", gen["parameters_bytes"]),
        ("decode state (KV cache, rows)", gen["decode_state_bytes"]),
        (f"working ({gen['working_program']})", gen["working_bytes"]),
        ("held-out evaluation", gen["evaluation_bytes"]),
        ("total", gen["per_device_bytes"]),
    ])  # fmt: skip
    if "pool_bytes" in report:
        lines.append(
            f"\nmemory pool: {_gib(report['pool_bytes'])} per device = "
            f"{_gib(report['device_memory_bytes'])} x {report['mem_fraction']:g} (JAX takes "
            "XLA_PYTHON_CLIENT_MEM_FRACTION of a GPU, 0.75 unless set; --mem-fraction plans "
            "another, 1 for a TPU)"
        )
    verdicts = {"train_step": "train step", "generator": "generator's devices"}
    if "trainer_host" in report:
        part = report["trainer_host"]
        lines.append("\nthe trainer's devices hold, per device (generators are jobs of their own):")
        lines += _table([
            ("train step", part["train_step_bytes"]),
            ("versions held for the generators", part["held_versions_bytes"]),
            ("or, between steps, evaluation", part["evaluation_bytes"]),
            ("total", part["per_device_bytes"]),
        ])  # fmt: skip
        verdicts = {"trainer_host": "trainer's devices", "generator": "a generator group's"}
    if "train_and_generate" in report:
        part = report["train_and_generate"]
        how = "at once" if part["concurrent"] else "with the train state resident"
        lines.append(f"\ntrain step + generator on the same devices ({how}): "
                     f"{_gib(part['per_device_bytes'])} per device")  # fmt: skip
        verdicts = {"train_step": "train step", "train_and_generate": "train + generator"}
    for name, title in verdicts.items():
        part = report[name]
        if "fits" in part:
            verdict = "yes" if part["fits"] else "NO"
            lines.append(f"  {title}: {_gib(part['per_device_bytes'])}, fits: {verdict}")
            if not part["fits"]:
                lines.append(f"    {part['advice']}")
    return "\n".join(lines)


def _lora_lines(part: dict[str, Any]) -> list[str]:
    """LoRA's resident train state per device beside full fine-tuning's."""
    full = part["full_fine_tuning"]
    lines = [
        f"\nLoRA rank {part['rank']} ({', '.join(part['targets'])}), base {part['base_dtype']}:",
        "  resident train state per device against full fine-tuning (float32) on this mesh",
    ]
    lines.append(f"  {'':<32}{'LoRA':>12}{'full':>12}")
    for label, key in [
        ("parameters", "parameters_bytes"),
        ("gradients", "gradient_bytes"),
        ("optimizer state", "optimizer_state_bytes"),
        ("total", "state_bytes"),
    ]:
        lines.append(f"  {label:<32}{_gib(part[key]):>12}{_gib(full[key]):>12}")
    lines.append(f"  LoRA saves {_gib(part['saving_bytes'])} per device")
    return lines


def _table(rows) -> list[str]:
    return [f"  {label:<32}{_gib(n):>12}" for label, n in rows]
