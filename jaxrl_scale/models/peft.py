"""PEFT adapter folders <-> a LoRA policy's adapters.

A folder is `adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` with one `lora_A.weight` [r, in] and `lora_B.weight` [out, r] per
adapted projection, named after the Hugging Face module they adapt
(`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`): what `peft` saves and
loads onto its base (`PeftModel.from_pretrained`). Our A is [*in, r] and B [r, *out]; the
in/out axes flatten as the kernel's do in hf.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from jaxrl_scale.configbase import ConfigError
from jaxrl_scale.models.config import LORA_TARGETS, LoRAConfig, ModelConfig
from jaxrl_scale.models.hf import CheckpointError, write_safetensors
from jaxrl_scale.models.lora import PROJECTIONS

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
_MODULE = {"attn": "self_attn", "mlp": "mlp"}
# adapter_config.json entries this reader cannot honour, with the value that means "unused".
_UNSUPPORTED = {
    "use_dora": False,
    "lora_bias": False,
    "bias": "none",
    "layers_to_transform": None,
    "layers_pattern": None,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "fan_in_fan_out": False,
}


def _tensor_name(layer: int, proj: str, which: str) -> str:
    module = _MODULE[PROJECTIONS[proj][0]]
    return f"{PREFIX}model.layers.{layer}.{module}.{proj}.lora_{which}.weight"


def read_adapter_config(path: str | Path) -> dict[str, Any]:
    file = Path(path) / CONFIG_FILE
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing (not a PEFT adapter folder)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{file}: peft_type {config['peft_type']!r} is not LORA")
    for key, unused in _UNSUPPORTED.items():
        if config.get(key, unused) not in (unused, None, {}, False, "none"):
            raise CheckpointError(f"{file}: {key}={config[key]!r} is not supported")
    return config


def _targets(config: dict[str, Any], file: Path) -> tuple[str, ...]:
    modules = config.get("target_modules")
    if modules in ("all-linear", ["all-linear"]):
        return LORA_TARGETS
    if isinstance(modules, str):  # a regular expression over module names
        raise CheckpointError(
            f"{file}: target_modules as a pattern ({modules!r}) is not supported; list the "
            "projections"
        )
    unknown = sorted(set(modules or ()) - set(LORA_TARGETS))
    if unknown or not modules:
        raise CheckpointError(
            f"{file}: target_modules {modules!r}: adapters on {unknown or 'nothing'} are not "
            f"supported (projections: {', '.join(LORA_TARGETS)})"
        )
    return tuple(p for p in LORA_TARGETS if p in modules)


def resolve_lora(cfg: LoRAConfig) -> LoRAConfig:
    """`cfg` with rank, alpha, targets and rslora from its `init_from` adapter folder. A rank
    set in the config that differs from the adapter's is an error."""
    folder = Path(cfg.init_from)
    config = read_adapter_config(folder)
    rank = int(config["r"])
    if cfg.rank and cfg.rank != rank:
        raise ConfigError(
            f"model.lora.rank: {cfg.rank}, but the adapter in {folder} has rank {rank} (leave "
            "it unset to take the adapter's)"
        )
    return dataclasses.replace(
        cfg,
        rank=rank,
        alpha=float(config.get("lora_alpha", 8)),
        targets=_targets(config, folder / CONFIG_FILE),
        rslora=bool(config.get("use_rslora", False)),
    )


def _adapter_paths(cfg: ModelConfig):
    """(state path of A, of B, layer, projection) for every adapter a config makes."""
    for i in range(cfg.num_layers):
        for proj in cfg.lora.projections:
            where, prefix = PROJECTIONS[proj]
            module = ("layers", i, where)
            yield (*module, f"{prefix}_lora_a"), (*module, f"{prefix}_lora_b"), i, proj


def load_adapter(path: str | Path, adapters: nnx.State, cfg: ModelConfig) -> nnx.State:
    """`adapters` (a LoRA policy's trainable state) with the values of the PEFT folder at
    `path`, each placed where the one it replaces was."""
    folder = Path(path)
    file = folder / WEIGHTS_FILE
    config = read_adapter_config(folder)
    if int(config["r"]) != cfg.lora.rank:
        raise CheckpointError(
            f"{folder}: rank {config['r']} adapters for a model.lora.rank={cfg.lora.rank} policy"
        )
    flat = dict(nnx.to_flat_state(adapters))
    try:
        handle = safe_open(file, "numpy")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
    with handle as f:
        names = set(f.keys())  # noqa: SIM118 (not a dict)
        expected = set()
        for a_path, b_path, layer, proj in _adapter_paths(cfg):
            for var_path, which in ((a_path, "A"), (b_path, "B")):
                name = _tensor_name(layer, proj, which)
                expected.add(name)
                if name not in names:
                    raise CheckpointError(f"{file}: missing tensor {name!r}")
                var = flat[var_path]
                value = var.get_value()
                shape = tuple(value.shape)
                array = f.get_tensor(name)
                want = _peft_shape(shape, which)
                if tuple(array.shape) != want:
                    raise CheckpointError(
                        f"{file}: tensor {name!r} has shape {tuple(array.shape)}, expected {want}"
                    )
                array = np.asarray(array, np.float32).T.reshape(shape)
                flat[var_path] = var.replace(jax.device_put(array, value.sharding))
        extra = sorted(names - expected)
        if extra:
            raise CheckpointError(f"{file}: tensors this policy has no adapter for: {extra[:5]}")
    return nnx.from_flat_state(flat)


def _peft_shape(shape: tuple[int, ...], which: str) -> tuple[int, int]:
    """PEFT's [r, in] (A) or [out, r] (B) for our A [*in, r] or B [r, *out]."""
    if which == "A":
        return (shape[-1], math.prod(shape[:-1]))
    return (math.prod(shape[1:]), shape[0])


def save_adapter(
    adapters: nnx.State, cfg: ModelConfig, path: str | Path, *, base: str | None = None
) -> Path:
    """Write `adapters` as a PEFT folder that `PeftModel.from_pretrained(base_model, path)`
    loads; `base` goes into `base_model_name_or_path`."""
    if not cfg.lora.enabled:
        raise ValueError("save_adapter: this policy has no LoRA adapters (model.lora.rank = 0)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    flat = dict(nnx.to_flat_state(adapters))
    tensors = {}
    for a_path, b_path, layer, proj in _adapter_paths(cfg):
        for var_path, which in ((a_path, "A"), (b_path, "B")):
            value = np.asarray(jax.device_get(flat[var_path].get_value()), np.float32)
            rows = math.prod(value.shape[:-1]) if which == "A" else value.shape[0]
            tensors[_tensor_name(layer, proj, which)] = np.ascontiguousarray(
                value.reshape(rows, -1).T
            )
    write_safetensors(tensors, path / WEIGHTS_FILE)
    lora = cfg.lora
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": list(lora.projections),
        "use_rslora": lora.rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return path
