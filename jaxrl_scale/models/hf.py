"""Hugging Face checkpoints <-> Policy: config.json, (sharded) safetensors, tokenizer.json.

No pickle anywhere: weights are read with `safetensors` lazily, tensor by tensor, and placed
directly with their target sharding when a mesh is given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers
from flax import nnx
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxrl_scale.configbase import asset_path
from jaxrl_scale.models.chat import load_chat_template
from jaxrl_scale.models.config import ModelConfig, RopeScalingConfig
from jaxrl_scale.models.lora import LoRAParam, adapted_modules, init_adapters, merged_kernel
from jaxrl_scale.models.moe import MoE
from jaxrl_scale.models.policy import Policy
from jaxrl_scale.models.tokenizer import Tokenizer
from jaxrl_scale.parallel.sharding import variable_sharding

ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_HF_NAMES = {arch: name for name, arch in ARCHITECTURES.items()}
INDEX_FILE = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry


class CheckpointError(ValueError):
    """A checkpoint folder cannot be read into a Policy; the message names the file or tensor."""


# --------------------------------------------------------------------------- config


def _rope_fields(hf: dict[str, Any]) -> tuple[float, RopeScalingConfig | None]:
    params = hf.get("rope_parameters") or {}  # transformers >= 5
    scaling = hf.get("rope_scaling") or params  # transformers 4 keeps theta at top level
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise CheckpointError(
            f"config.json: rope type {rope_type!r} is not supported (default, llama3)"
        )
    return theta, RopeScalingConfig(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """ModelConfig from a parsed HF config.json; `overrides` set e.g. dtype or lm_head_dtype."""
    names = hf.get("architectures") or []
    arch = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(
            f"config.json: unsupported architecture {names or hf.get('model_type')!r}; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported")
    if hf.get("use_sliding_window") or hf.get("mlp_bias"):
        raise CheckpointError(
            "config.json: sliding-window attention and mlp_bias are not supported"
        )
    if arch != "qwen2" and hf.get("attention_bias"):
        raise CheckpointError(f"config.json: attention_bias is not supported for {arch}")
    theta, scaling = _rope_fields(hf)
    fields = dict(
        architecture=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "qwen3_moe"),
    )
    if arch == "qwen3_moe":  # transformers 5 writes num_local_experts, the hub num_experts
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        missing = [k for k in ("num_experts_per_tok", "moe_intermediate_size") if k not in hf]
        if experts is None or missing:
            missing = ["num_experts"] * (experts is None) + missing
            raise CheckpointError(f"config.json: Qwen3-MoE without {', '.join(missing)}")
        fields.update(
            num_experts=experts,
            num_experts_per_tok=hf["num_experts_per_tok"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=hf.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        )
    return ModelConfig(**{**fields, **overrides})


def config_to_hf(cfg: ModelConfig, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """The HF config.json for `cfg` (rope keys in the form transformers 4 and 5 both read)."""
    hf: dict[str, Any] = {
        "architectures": [_HF_NAMES[cfg.architecture]],
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.qkv_bias,
        "torch_dtype": "float32",
    }
    if cfg.head_dim is not None:
        hf["head_dim"] = cfg.head_dim
    if cfg.architecture == "qwen3_moe":
        hf.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
        )
    if cfg.rope_scaling is not None:
        hf["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    if tokenizer is not None:
        hf["eos_token_id"] = (
            list(tokenizer.eos_ids) if len(tokenizer.eos_ids) > 1 else tokenizer.eos_ids[0]
        )
        hf["pad_token_id"] = tokenizer.pad_id
        hf["bos_token_id"] = tokenizer.bos_id
    return hf


# --------------------------------------------------------------------------- tensor names


def _hf_variables(model: Policy) -> Iterator[tuple[str, nnx.Variable, int, int | None]]:
    """(HF tensor name, variable, n_in, expert) for every tensor of `model`.

    n_in > 0 marks a matmul kernel: its first n_in axes flatten into HF's input dimension and the
    rest into the output dimension, stored transposed ([out, in]) by HF. n_in = 0: same values,
    HF's shape is our shape flattened to its own rank (biases [K, E] -> [K * E]). `expert`: the
    tensor is that slice of an MoE layer's stacked experts (HF keeps one tensor per expert).
    """
    yield "model.embed_tokens.weight", model.embedding, 0, None
    for i, layer in enumerate(model.layers):
        p, attn, mlp = f"model.layers.{i}.", layer.attn, layer.mlp
        yield p + "input_layernorm.weight", layer.attn_norm, 0, None
        yield p + "post_attention_layernorm.weight", layer.mlp_norm, 0, None
        for proj in "qkv":
            yield f"{p}self_attn.{proj}_proj.weight", getattr(attn, f"{proj}_kernel"), 1, None
        yield f"{p}self_attn.o_proj.weight", attn.o_kernel, 2, None
        if model.cfg.qkv_bias:
            for proj in "qkv":
                yield f"{p}self_attn.{proj}_proj.bias", getattr(attn, f"{proj}_bias"), 0, None
        if model.cfg.qk_norm:
            yield p + "self_attn.q_norm.weight", attn.q_norm, 0, None
            yield p + "self_attn.k_norm.weight", attn.k_norm, 0, None
        if isinstance(mlp, MoE):
            yield p + "mlp.gate.weight", mlp.router_kernel, 1, None
            for proj in ("gate", "up", "down"):
                kernel = getattr(mlp, f"{proj}_kernel")
                for e in range(kernel.get_value().shape[0]):
                    yield f"{p}mlp.experts.{e}.{proj}_proj.weight", kernel, 1, e
            continue
        for proj in ("gate", "up", "down"):
            yield f"{p}mlp.{proj}_proj.weight", getattr(mlp, f"{proj}_kernel"), 1, None
    yield "model.norm.weight", model.final_norm, 0, None
    if not model.cfg.tie_embeddings:
        yield "lm_head.weight", model.lm_head, 1, None


def hf_shape(shape: tuple[int, ...], n_in: int, name: str) -> tuple[int, ...]:
    """The shape HF stores for a variable of `shape`."""
    if n_in:
        return (math.prod(shape[n_in:]), math.prod(shape[:n_in]))
    return (math.prod(shape),) if name.endswith(".bias") else tuple(shape)


def to_hf_layout(array: np.ndarray, n_in: int, name: str) -> np.ndarray:
    if n_in:
        return array.reshape(math.prod(array.shape[:n_in]), -1).T
    return array.reshape(hf_shape(array.shape, n_in, name))


def from_hf_layout(array: np.ndarray, n_in: int, shape: tuple[int, ...]) -> np.ndarray:
    return (array.T if n_in else array).reshape(shape)


# --------------------------------------------------------------------------- load


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index when sharded."""
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: malformed index ({e})") from None
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{path}: no model.safetensors or {INDEX_FILE}")
    try:
        with safe_open(single, "numpy") as f:
            return dict.fromkeys(f.keys(), single)  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{single}: not a readable safetensors file ({e})") from None


def _read_json(file: Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None


def load_tokenizer(path: str | Path) -> Tokenizer:
    """tokenizer.json plus special ids from generation_config.json / config.json, and the chat
    template (with its special token strings) when the folder has one."""
    path = Path(path)
    file = path / "tokenizer.json"
    if not file.exists():
        raise CheckpointError(f"{file}: missing")
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises a bare Exception subclass
        raise CheckpointError(f"{file}: not a readable tokenizer ({e})") from None
    gen_file, config_file = path / "generation_config.json", path / "config.json"
    gen = _read_json(gen_file) if gen_file.exists() else {}
    # A model folder has config.json; a tokenizer folder (save_tokenizer) may have only
    # generation_config.json, which then names the special ids.
    if config_file.exists() or not gen:
        hf = _read_json(config_file)
    else:
        hf = {k: gen[k] for k in ("pad_token_id", "bos_token_id") if k in gen}
    eos = gen.get("eos_token_id", hf.get("eos_token_id"))
    if eos is None:
        raise CheckpointError(f"{path}: no eos_token_id in generation_config.json or config.json")
    eos_ids = eos if isinstance(eos, list) else [eos]
    try:
        chat_template = load_chat_template(path)
    except (ValueError, OSError) as e:
        raise CheckpointError(str(e)) from None
    return Tokenizer(
        backend,
        eos_ids=eos_ids,
        pad_id=hf.get("pad_token_id"),
        bos_id=hf.get("bos_token_id"),
        chat_template=chat_template,
    )


def resolve_checkpoint(path: str | Path) -> Path:
    """A folder path, or "asset:NAME" for a checkpoint shipped in jaxrl_scale/assets."""
    text = str(path)
    if not text.startswith("asset:"):
        return Path(path)
    folder = asset_path(text)
    if not (folder / "config.json").exists():
        hint = ""
        if text == "asset:demo_policy":
            hint = (
                "; rebuild it with scripts/make_demo_policy.py, or run "
                "jaxrl-scale demo --from-scratch"
            )
        raise CheckpointError(f"{text}: the packaged checkpoint {folder} is missing{hint}")
    return folder


def load_pretrained(
    path: str | Path, *, mesh: Mesh | None = None, seed: int = 0, **config_overrides: Any
) -> tuple[Policy, Tokenizer]:
    """Read an HF folder (or "asset:NAME", a packaged one) into (Policy, Tokenizer).
    Parameters are stored float32.

    With `mesh`, each tensor goes straight to its sharding (no full copy on one device).
    `config_overrides` set ModelConfig fields the checkpoint does not fix (dtype, lm_head_dtype,
    lora: a LoRA policy's adapters start fresh from `seed`, B = 0).
    """
    path = resolve_checkpoint(path)
    cfg = config_from_hf(_read_json(path / "config.json"), **config_overrides)
    model = nnx.eval_shape(lambda: Policy(cfg, rngs=nnx.Rngs(0)))
    files = _weight_files(path)
    expected = {name for name, *_ in _hf_variables(model)}
    unexpected = sorted(
        n
        for n in files
        if n not in expected
        and not n.endswith(_IGNORED_SUFFIXES)
        and not (cfg.tie_embeddings and n == "lm_head.weight")
    )
    if unexpected:
        raise CheckpointError(
            f"{path}: unexpected tensors for {cfg.architecture}: {unexpected[:5]}"
        )
    handles: dict[Path, Any] = {}
    stacked: dict[int, np.ndarray] = {}  # id(variable) -> its experts, filled slice by slice
    with contextlib.ExitStack() as stack:
        for name, variable, n_in, expert in _hf_variables(model):
            if name not in files:
                raise CheckpointError(f"{path}: missing tensor {name!r}")
            file = files[name]
            if file not in handles:
                try:
                    handles[file] = stack.enter_context(safe_open(file, "numpy"))
                except (SafetensorError, OSError) as e:
                    raise CheckpointError(
                        f"{file}: not a readable safetensors file ({e})"
                    ) from None
            try:
                array = handles[file].get_tensor(name)
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{file}: cannot read tensor {name!r} ({e})") from None
            shape = tuple(variable.get_value().shape)
            want = shape if expert is None else shape[1:]
            if tuple(array.shape) != hf_shape(want, n_in, name):
                raise CheckpointError(
                    f"{path}: tensor {name!r} has shape {tuple(array.shape)}, expected "
                    f"{hf_shape(want, n_in, name)}"
                )
            array = from_hf_layout(np.asarray(array, dtype=np.float32), n_in, want)
            if expert is not None:
                full = stacked.setdefault(id(variable), np.empty(shape, np.float32))
                full[expert] = array
                if expert < shape[0] - 1:
                    continue
                array = stacked.pop(id(variable))  # the last expert: place the whole stack
            target = variable_sharding(variable, mesh) if mesh is not None else None
            variable.set_value(jax.device_put(array, target))
    if cfg.lora.enabled:
        _fresh_adapters(model, seed, mesh)
    return model, load_tokenizer(path)


def _fresh_adapters(model: Policy, seed: int, mesh: Mesh | None) -> None:
    """A loaded base's adapters (abstract until now): A drawn as a fresh policy's, B = 0."""
    for _, _, module, prefix in adapted_modules(model):
        b = getattr(module, f"{prefix}_lora_b")
        b.set_value(jnp.zeros(b.get_value().shape, jnp.float32))
    init_adapters(model, jax.random.fold_in(jax.random.key(seed), 1))
    for _, _, module, prefix in adapted_modules(model):
        for which in ("a", "b"):
            variable = getattr(module, f"{prefix}_lora_{which}")
            target = variable_sharding(variable, mesh) if mesh is not None else None
            variable.set_value(jax.device_put(variable.get_value(), target))


# --------------------------------------------------------------------------- save


def save_pretrained(
    model: Policy,
    tokenizer: Tokenizer,
    path: str | Path,
    *,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write `model` and `tokenizer` as an HF folder (float32 weights), sharded if asked. A
    LoRA policy is written merged (a plain checkpoint transformers loads as it is)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if model.cfg.lora.enabled:  # adapters folded in: W + s A B (peft.save_adapter keeps them)
        model = merged_module(model)
    tensors = {}
    host: tuple[Any, np.ndarray] = (None, np.empty(0))  # an MoE stack is fetched once
    for name, variable, n_in, expert in _hf_variables(model):
        if host[0] is not variable:
            host = (variable, np.asarray(jax.device_get(variable.get_value()), np.float32))
        array = host[1] if expert is None else host[1][expert]
        tensors[name] = np.ascontiguousarray(to_hf_layout(array, n_in, name))
    shards = _split_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        write_safetensors(shards[0], path / "model.safetensors")
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(shard, path / file)
            weight_map.update(dict.fromkeys(shard, file))
        total = sum(a.nbytes for a in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(config_to_hf(model.cfg, tokenizer), indent=2))
    save_tokenizer(tokenizer, path)
    return path


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> Path:
    """`tokenizer` into folder `path` as `load_tokenizer` reads it back: tokenizer.json, the
    chat template if any, and generation_config.json with the special ids."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = {"eos_token_id": list(tokenizer.eos_ids), "pad_token_id": tokenizer.pad_id}
    if tokenizer.bos_id is not None:
        gen["bos_token_id"] = tokenizer.bos_id
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tokenizer.save(path)
    return path


def write_safetensors(tensors: dict[str, np.ndarray], file: Path) -> None:
    """`tensors` as a safetensors file with the mode other files get here (the process's
    umask: 644 by default), not the 600 the safetensors library leaves."""
    save_file(tensors, str(file), metadata={"format": "pt"})
    umask = os.umask(0)  # reading the umask means setting it: put it straight back
    os.umask(umask)
    file.chmod(0o666 & ~umask)


def _split_shards(tensors: dict[str, np.ndarray], max_bytes: int | None) -> list[dict]:
    if max_bytes is None:
        return [tensors]
    shards: list[dict] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    return shards


def merged_module(model):
    """A LoRA policy's weights folded into a plain policy (LoRA off, float32 kernels
    W + s A B): what a merged Hugging Face export writes. Host-side, one kernel at a time."""
    cfg = model.cfg
    plain_cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=0,
                                                                  base_dtype="float32",
                                                                  init_from=None))  # fmt: skip
    plain = nnx.eval_shape(lambda: Policy(plain_cfg, rngs=nnx.Rngs(0)))
    _, plain_state = nnx.split(plain)
    _, _, base_state = nnx.split(model, LoRAParam, ...)
    flat = dict(nnx.to_flat_state(base_state))
    values = {
        path: np.asarray(jax.device_get(var.get_value()), np.float32) for path, var in flat.items()
    }
    scale = cfg.lora.scale
    for i, _, module, prefix in adapted_modules(model):
        where = "attn" if prefix in ("q", "k", "v", "o") else "mlp"
        path = ("layers", i, where, f"{prefix}_kernel")
        values[path] = merged_kernel(
            values[path],
            jax.device_get(getattr(module, f"{prefix}_lora_a").get_value()),
            jax.device_get(getattr(module, f"{prefix}_lora_b").get_value()),
            scale,
        )
    for path, var in nnx.to_flat_state(plain_state):
        var.set_value(jnp.asarray(values[path]))
    return nnx.merge(nnx.split(plain)[0], plain_state)
