"""What every plan compiles from and reads back: the run's model resolved, its state as
ShapeDtypeStructs placed on a mesh, the bytes of a state or an argument per device, XLA's
memory analysis broken down, and which attention and expert programs a platform compiles."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx

from jaxrl_scale.models import attention, lora, moe
from jaxrl_scale.models.hf import config_from_hf, resolve_checkpoint
from jaxrl_scale.models.peft import resolve_lora
from jaxrl_scale.models.policy import Policy, for_generation
from jaxrl_scale.parallel import sharding

if TYPE_CHECKING:  # the root config composes every part's section
    from jaxrl_scale.config import ExperimentConfig


GIB = 2**30


GIB = 2**30
DEFAULT_PROMPT_LEN = 1024  # tokens of a math prompt when --prompt-len does not say


# The share of a GPU's memory JAX takes for its pool when XLA_PYTHON_CLIENT_MEM_FRACTION is
# not set (it preallocates it at start-up): what a plan compares with on a GPU.
JAX_GPU_MEM_FRACTION = 0.75
PROCEDURAL = ("arithmetic", "countdown")  # tasks whose prompts are generated, not read


def task_prompt_len(cfg: ExperimentConfig) -> tuple[int, str]:
    """(prompt slots, where the number comes from). A procedural task's prompts are generated
    and measured (padded to a multiple of 8, as the sampler pads); a dataset's are not read."""
    names = [c.name for c in cfg.task.mixture] or [cfg.task.name]
    if any(n not in PROCEDURAL for n in names):  # a dataset: its prompts are not read
        return DEFAULT_PROMPT_LEN, f"default for {cfg.task.name}; set --prompt-len"
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


def placed(state, mesh):
    """ShapeDtypeStructs of an abstract State placed by their variables' logical axes (other
    leaves replicated), as the run's arrays would be."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        state,
        sharding.state_shardings(state, mesh),
    )


def abstract_policy(cfg: ExperimentConfig):
    """(graphdef, frozen base or None, trainable parameters) as a run splits its policy
    (`lora.split_policy`: with LoRA the base in `model.lora.base_dtype` and the adapters;
    without, None and every parameter), as unplaced ShapeDtypeStructs."""
    return nnx.eval_shape(lambda: lora.split_policy(Policy(cfg.model, rngs=nnx.Rngs(0)), cfg.model))


def abstract_params(cfg: ExperimentConfig, mesh, *, generation: bool = False):
    """(graphdef, parameters as ShapeDtypeStructs sharded by their logical axes on `mesh`);
    with `generation`, the dtypes the generator decodes with (`model.for_generation`). A LoRA
    generator always decodes in those (`RolloutWorker`), the base's and the adapters' alike."""
    graphdef, frozen, params = abstract_policy(cfg)
    state = lora.merge_params(frozen, params)
    if generation or frozen is not None:
        state = jax.eval_shape(lambda s: for_generation(s, cfg.model, copy=False), state)
    return graphdef, placed(state, mesh)


def adapter_bytes(state, *, per_device: bool = True) -> int:
    """Bytes of the LoRA adapters in a placed abstract state (0 without LoRA): one device's
    shards, or with `per_device` False the whole arrays."""
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    size = per_device_bytes if per_device else lambda x: x.size * np.dtype(x.dtype).itemsize
    return sum(size(v.get_value()) for v in variables if isinstance(v, lora.LoRAParam))


def narrowed_bytes(cfg: ExperimentConfig, mesh) -> int:
    """Per-device bytes of the new buffers a LoRA generator sharing the trainer's devices
    makes of the frozen base (`for_generation` without a copy: the leaves it narrows to the
    compute dtype, e.g. an untied embedding; the rest are the trainer's own buffers)."""
    _, frozen, _ = abstract_policy(cfg)
    wide = placed(frozen, mesh)
    narrow = placed(
        jax.eval_shape(lambda s: for_generation(s, cfg.model, copy=False), frozen), mesh
    )
    return sum(
        per_device_bytes(n)
        for w, n in zip(jax.tree.leaves(wide), jax.tree.leaves(narrow), strict=True)
        if n.dtype != w.dtype
    )


def breakdown(compiled) -> dict[str, int]:
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


def tree_bytes(state) -> int:
    return sum(per_device_bytes(x) for x in jax.tree.leaves(state))


def per_device_bytes(x) -> int:
    shard = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return int(np.prod(shard)) * 8  # a threefry key: two uint32
    return int(np.prod(shard)) * np.dtype(x.dtype).itemsize


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


def attention_program(cfg: ExperimentConfig, prompt_len: int) -> str:
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


def experts_program(cfg: ExperimentConfig) -> tuple[str, str | None]:
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
