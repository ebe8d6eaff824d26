"""Will a config fit? Compile its train step and a decode chunk from abstract shapes and read
XLA's memory analysis, per device, before anything is allocated.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        jaxrl-scale memory --config configs/scalerl_qwen3-8b_math.yaml --device-memory 80

Nothing here touches real weights or data: the model, optimizer state and batches are
ShapeDtypeStructs carrying the shardings the run would give them, so a laptop with fake CPU
devices plans a pod's run. The numbers are what XLA's compiler reserves for one device on the
platform it compiled for (the CPU compiler's buffer assignment when run on fake devices: the
same program and shapes as on an accelerator, though fusion and scheduling differ, so treat
a margin of 10-15% as noise).

On CPU a bf16 program's temporaries hold float32 copies of every bf16 matmul operand (the CPU
has no bf16 matmuls; for a decode chunk that is every layer's weights and the whole KV cache,
at twice their bytes: measured, 1.78 GiB per Qwen3-8B layer at 64 slots x 17k tokens). An
accelerator makes no such copies, so for a bf16 config the CPU also compiles the float32
program (no copies, activations twice as wide) and reports the smaller of the two
temporaries, each an upper bound; both stay in the report.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxrl_scale import sharding
from jaxrl_scale.config import ExperimentConfig
from jaxrl_scale.engine import abstract_slots
from jaxrl_scale.hf import config_from_hf, resolve_checkpoint
from jaxrl_scale.model import Policy, for_generation
from jaxrl_scale.rollout import decodes_with_copy
from jaxrl_scale.sampler import Interruption, Sampling, decode
from jaxrl_scale.step import Batch, TrainState, compile_run_step, make_optimizer

GIB = 2**30
DEFAULT_PROMPT_LEN = 1024  # tokens of a math prompt when --prompt-len does not say


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
    the weights are not read."""
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


def _abstract_params(cfg: ExperimentConfig, mesh, *, generation: bool = False):
    """(graphdef, parameters as ShapeDtypeStructs sharded by their logical axes on `mesh`);
    with `generation`, the dtypes the generator decodes with (`model.for_generation`)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Policy(cfg.model, rngs=nnx.Rngs(0))))
    if generation:
        state = jax.eval_shape(lambda s: for_generation(s, cfg.model, copy=False), state)
    return graphdef, _placed(state, mesh)


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
    batch), temporaries (activations, gradients, the update), outputs not aliased."""
    graphdef, params = _abstract_params(cfg, mesh)
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
    batch_shapes = Batch.shapes(rows, prompt_len, cfg.sampler.max_new_tokens)
    batch_sharding = sharding.batch_shardings(batch_shapes, mesh)
    batch = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        batch_shapes,
        batch_sharding,
    )
    step = compile_run_step(
        cfg, graphdef, tx, state_sharding=state_sharding, batch_sharding=batch_sharding
    )
    out = _breakdown(step.lower(state, batch).compile())
    param_bytes = sum(_per_device_bytes(x) for x in jax.tree.leaves(state.params))
    out["parameters_bytes"] = param_bytes
    out["optimizer_state_bytes"] = sum(
        _per_device_bytes(x) for x in jax.tree.leaves(state.opt_state)
    )
    out["rows_per_micro_batch"] = rows // cfg.train.micro_batches
    return out


def generate_memory(
    cfg: ExperimentConfig, mesh, prompt_len: int, *, copy: bool = True, copies: int = 1
) -> dict[str, Any]:
    """A decode chunk over the generator's slots: its per-device bytes (the parameters, the
    KV cache and the rows' buffers are arguments; the state is donated), plus `copies` - 1
    more parameter copies held beside it. `copy`: the generator decodes with its own copy of
    the parameters (`rollout.decodes_with_copy`), in the dtypes of `model.for_generation`;
    else with the trainer's."""
    graphdef, params = _abstract_params(cfg, mesh, generation=copy)
    slots = cfg.sampler.slots or cfg.train.prompts_per_step * cfg.train.group_size
    n_new = cfg.sampler.max_new_tokens
    state = abstract_slots(cfg.model, slots, prompt_len, n_new, mesh)
    i = cfg.sampler.interruption
    interruption = None
    if i is not None:  # the text's tokens only matter for their count: one placeholder each
        text = tuple(range(max(1, len(i.text) // 4)))
        interruption = Interruption(text, i.think_min, i.think_max, i.answer_budget, (1,))
    lowered = decode.lower(
        graphdef,
        params,
        state,
        0,
        max(cfg.sampler.chunk_size, 1),
        sampling=Sampling(cfg.sampler.temperature, 1.0, 0),
        eos_ids=(1,),
        pad_id=0,
        interruption=interruption,
        prompt_len=prompt_len,
    )
    out = _breakdown(lowered.compile())
    cache = state.cache
    out["kv_cache_bytes"] = sum(_per_device_bytes(x) for x in jax.tree.leaves((cache.k, cache.v)))
    out["parameters_bytes"] = sum(_per_device_bytes(x) for x in jax.tree.leaves(params))
    out["parameter_copies"] = copies
    out["per_device_bytes"] += (copies - 1) * out["parameters_bytes"]
    out["slots"] = slots
    return out


def _per_device_bytes(x) -> int:
    shard = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    return int(np.prod(shard)) * np.dtype(x.dtype).itemsize


def plan(
    cfg: ExperimentConfig, *, prompt_len: int | None = None, device_memory_gib: float | None = None
) -> dict[str, Any]:
    """Both programs' per-device bytes on the config's meshes, whether each fits in
    `device_memory_gib` (when given), and for one that does not, its biggest term and the
    settings that shrink it."""
    source = "--prompt-len"
    if prompt_len is None:
        prompt_len, source = task_prompt_len(cfg)
    if prompt_len < 1:
        raise ValueError(f"prompt length must be >= 1, got {prompt_len}")
    stand_in = None
    if jax.default_backend() == "cpu" and cfg.model.attention in ("cudnn", "splash"):
        # The fused kernels do not compile for CPU (splash only interpreted): the blockwise
        # attention, whose memory is linear in T as theirs is, stands in for them.
        stand_in = f"{cfg.model.attention} estimated as blockwise on CPU"
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="blockwise"))
    mesh, gen_mesh = sharding.make_meshes(cfg)
    sharding.check_divisible(cfg, mesh, gen_mesh)
    copy = decodes_with_copy(cfg, gen_mesh)
    # pipeline_rl: new weights arrive while a chunk decodes with older ones, so up to three
    # copies sit on the generator's devices (the running chunk's, the newest published and
    # not yet picked up, the one being placed).
    copies = 3 if cfg.pipeline.mode == "pipeline_rl" else 1

    def programs(cfg):
        return {
            "train_step": train_step_memory(cfg, mesh, prompt_len),
            "generate": generate_memory(
                cfg, gen_mesh or mesh, prompt_len, copy=copy, copies=copies
            ),
        }

    report = {
        "sequence_length": prompt_len + cfg.sampler.max_new_tokens,
        "prompt_len": prompt_len,
        "prompt_len_from": source,
        "max_new_tokens": cfg.sampler.max_new_tokens,
        "train_mesh": dict(mesh.shape),
        "generate_mesh": dict((gen_mesh or mesh).shape),
        **programs(cfg),
    }
    if stand_in:
        report["attention"] = stand_in
    if jax.default_backend() == "cpu" and cfg.model.dtype != "float32":
        # The CPU compiler has no bf16 matmuls: it converts their operands (every layer's
        # weights, the whole KV cache) to float32 copies that an accelerator never makes. The
        # same program in float32 has no such copies and activations twice as wide: its
        # temporaries are a second upper bound. Report the smaller one.
        wide = programs(
            dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="float32"))
        )
        for name, part in wide.items():
            _bound_temporaries(report[name], part["temporaries_bytes"])
    names = ["train_step", "generate"]
    if gen_mesh is None and cfg.pipeline.mode == "pipeline_rl":
        # One set of devices runs both programs at once: each holds its buffers throughout.
        both = report["train_step"]["per_device_bytes"] + report["generate"]["per_device_bytes"]
        report["train_and_generate"] = {"per_device_bytes": both}
        names.append("train_and_generate")
    if device_memory_gib is not None:
        limit = int(device_memory_gib * GIB)
        report["device_memory_bytes"] = limit
        for name in names:
            part = report[name]
            part["fits"] = part["per_device_bytes"] <= limit
            if not part["fits"]:
                part["advice"] = _advice(name, part, cfg)
        report["fits"] = all(report[name]["fits"] for name in names)
    return report


def _bound_temporaries(part: dict[str, Any], float32_program: int) -> None:
    as_compiled = part["temporaries_bytes"]
    part["temporaries_bytes_as_compiled"] = as_compiled
    part["temporaries_bytes_float32_program"] = float32_program
    part["temporaries_bytes"] = min(as_compiled, float32_program)
    part["per_device_bytes"] += part["temporaries_bytes"] - as_compiled


def _advice(name: str, part: dict[str, Any], cfg: ExperimentConfig) -> str:
    m = cfg.model
    if name == "train_and_generate":
        return (
            "the train step and the generator share these devices in pipeline_rl and run at "
            "once: give the generator its own (pipeline.generator_devices), or shrink either "
            "program (sampler.slots; train.micro_batches, model.remat)"
        )
    if name == "generate":
        if part["kv_cache_bytes"] >= part["temporaries_bytes"]:
            return (
                f"the KV cache ({_gib(part['kv_cache_bytes'])} per device) is the biggest term: "
                f"fewer rows in flight (sampler.slots, now {part['slots']}) or more generator "
                "devices (pipeline.generator_devices, or a larger batch axis of the mesh)"
            )
        return (
            f"temporaries ({_gib(part['temporaries_bytes'])}) are the biggest term: fewer rows "
            f"in flight (sampler.slots, now {part['slots']}) or more generator devices"
        )
    state = part["parameters_bytes"] + part["optimizer_state_bytes"]
    if state >= part["temporaries_bytes"]:
        return (
            f"parameters + optimizer state ({_gib(state)} per device) are the biggest term: "
            f"shard them over more devices (mesh.fsdp, now {cfg.mesh.fsdp})"
        )
    knobs = [f"more train.micro_batches (now {cfg.train.micro_batches})"]
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


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def format_plan(report: dict[str, Any]) -> str:
    lines = [
        f"sequence length {report['sequence_length']:,} tokens "
        f"(prompt {report['prompt_len']:,} [{report['prompt_len_from']}] + max_new_tokens "
        f"{report['max_new_tokens']:,})"
    ]
    if "attention" in report:
        lines.append(f"attention: {report['attention']}")
    titles = {
        "train_step": ("train step", report["train_mesh"]),
        "generate": ("generate (one decode chunk)", report["generate_mesh"]),
    }
    for name, (title, mesh) in titles.items():
        part = report[name]
        axes = " ".join(f"{k}={v}" for k, v in mesh.items())
        lines.append(f"\n{title}, mesh {axes}, per device:")
        rows = [("parameters", part["parameters_bytes"])]
        if part.get("parameter_copies", 1) > 1:
            n = part["parameter_copies"]
            rows.append((f"  x{n}: weights in flight", n * part["parameters_bytes"]))
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
        lines += [f"  {label:<26}{_gib(n):>12}" for label, n in rows]
        if "temporaries_bytes_as_compiled" in part:
            lines.append(
                "  temporaries: the smaller of two upper bounds, bf16 as the CPU compiles it "
                f"({_gib(part['temporaries_bytes_as_compiled'])}, float32 copies of matmul "
                f"operands) and the float32 program "
                f"({_gib(part['temporaries_bytes_float32_program'])})"
            )
        if "fits" in part:
            limit = _gib(report["device_memory_bytes"])
            lines.append(f"  fits in {limit}: {'yes' if part['fits'] else 'NO'}")
            if not part["fits"]:
                lines.append(f"  {part['advice']}")
    if "train_and_generate" in report:
        part = report["train_and_generate"]
        lines.append(
            "\ntrain step + generate on the same devices (pipeline_rl runs both at once): "
            f"{_gib(part['per_device_bytes'])} per device"
        )
        if "fits" in part:
            lines.append(f"  fits: {'yes' if part['fits'] else 'NO'}")
            if not part["fits"]:
                lines.append(f"  {part['advice']}")
    return "\n".join(lines)
