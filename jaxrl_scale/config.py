"""Typed experiment configuration: frozen dataclasses per concern, filled from YAML.

`load_config("configs/demo.yaml", overrides=["model.num_layers=4"])` reads the YAML file, applies
dotted `key=value` overrides (values parsed as YAML scalars), and builds the dataclasses with
dacite. An unknown key (with the closest valid key), a wrong type or an out-of-range value is a
`ConfigError` naming the dotted key.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import dacite
import yaml

DType = Literal["float32", "bfloat16"]


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the dotted key."""


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScalingConfig:
    """Llama-3 frequency-dependent RoPE scaling (HF `rope_type: llama3`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        _require(
            self.factor >= 1.0, "model.rope_scaling.factor", f"must be >= 1, got {self.factor}"
        )
        _require(
            0 < self.low_freq_factor < self.high_freq_factor,
            "model.rope_scaling",
            "need 0 < low_freq_factor < high_freq_factor, got "
            f"{self.low_freq_factor}, {self.high_freq_factor}",
        )
        _require(
            self.original_max_position_embeddings > 0,
            "model.rope_scaling.original_max_position_embeddings",
            "must be > 0",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Decoder-only policy of the Qwen2/Qwen2.5, Qwen3 and Llama-3 families.

    `architecture` fixes the HF naming on export; `qkv_bias` (Qwen2) and `qk_norm` (Qwen3) are the
    switches that actually differ. Parameters are always stored in float32; `dtype` is the compute
    dtype. `lm_head_dtype: float32` runs the vocabulary projection on float32 inputs with float32
    accumulation (ScaleRL's FP32 head); `bfloat16` is the other arm of that ablation.
    """

    architecture: Literal["qwen2", "qwen3", "llama"] = "qwen2"
    vocab_size: int = 64
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_heads
    rope_theta: float = 10_000.0
    rope_scaling: RopeScalingConfig | None = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    dtype: DType = "float32"
    lm_head_dtype: DType = "float32"
    logits_chunk_size: int = 256  # tokens per chunk when computing per-token log-probs

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "logits_chunk_size",
        ):
            value = getattr(self, name)
            _require(value > 0, f"model.{name}", f"must be > 0, got {value}")
        _require(
            self.num_heads % self.num_kv_heads == 0,
            "model.num_kv_heads",
            f"must divide num_heads ({self.num_heads}), got {self.num_kv_heads}",
        )
        if self.head_dim is None:
            _require(
                self.hidden_size % self.num_heads == 0,
                "model.head_dim",
                f"unset, and hidden_size ({self.hidden_size}) is not divisible by num_heads "
                f"({self.num_heads}); set it explicitly",
            )
        _require(self.resolved_head_dim % 2 == 0, "model.head_dim", "must be even for RoPE")
        _require(self.rope_theta > 0, "model.rope_theta", f"must be > 0, got {self.rope_theta}")
        _require(
            self.rms_norm_eps > 0, "model.rms_norm_eps", f"must be > 0, got {self.rms_norm_eps}"
        )

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh shape. -1 on one axis means "all remaining devices"."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for name, size in sizes.items():
            _require(size == -1 or size >= 1, f"mesh.{name}", f"must be -1 or >= 1, got {size}")
        _require(list(sizes.values()).count(-1) <= 1, "mesh", "at most one axis may be -1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    seed: int = 0
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)


# --------------------------------------------------------------------------- YAML plumbing


def _dataclass_of(tp: Any) -> type | None:
    """The dataclass inside `tp` (also `X | None`), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        return inner[0] if len(inner) == 1 else None
    return None


def _check_keys(cls: type, data: Mapping[str, Any], prefix: str) -> None:
    """Raise for any key in `data` that `cls` lacks, suggesting the closest valid one."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{dotted}'{hint} (valid: {', '.join(names)})")
        sub = _dataclass_of(hints[key])
        if sub is not None and isinstance(value, Mapping):
            _check_keys(sub, value, f"{dotted}.")


def _to_float(value: Any) -> Any:
    # YAML 1.1 reads "1e-6" as a string; accept numeric strings and ints for float fields.
    if isinstance(value, bool):
        return value  # left for dacite to reject
    if isinstance(value, int):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def from_dict(cls: type, data: Mapping[str, Any], prefix: str = ""):
    """Build dataclass `cls` from nested mappings, strictly."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    _check_keys(cls, data, prefix)
    try:
        return dacite.from_dict(
            cls, dict(data), config=dacite.Config(strict=True, type_hooks={float: _to_float})
        )
    except dacite.WrongTypeError as e:
        key = f"{prefix}{e.field_path}"
        raise ConfigError(f"{key}: expected {_type_name(e.field_type)}, got {e.value!r}") from None
    except dacite.DaciteError as e:
        raise ConfigError(f"{prefix or 'config'}: {e}") from None


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def parse_override(item: str) -> tuple[list[str], Any]:
    """'a.b=value' -> (['a', 'b'], parsed value); the value is read as a YAML scalar."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override '{item}' must look like key.path=value")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else None


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    f"override '{item}': '{'.'.join(path[: i + 1])}' is not a section"
                )
            node = child
        node[path[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Read YAML `path` (or start from defaults) and apply dotted overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
    return from_dict(ExperimentConfig, apply_overrides(data, overrides))


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
