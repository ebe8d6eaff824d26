"""Typed experiment configuration: frozen dataclasses per concern, filled from YAML.

`load_config("configs/demo.yaml", overrides=["model.num_layers=4"])` reads the YAML file (and
the file its top-level `base:` names, which it overrides), applies dotted `key=value` overrides
(values parsed as YAML scalars), and builds the dataclasses with dacite. An unknown key (with
the closest valid key), a wrong type or an out-of-range value is a `ConfigError` naming the
dotted key.
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

from jaxrl_scale.configbase import ASSET, ConfigError, DType, asset_path, require
from jaxrl_scale.fit.config import ForecastConfig
from jaxrl_scale.generation.config import (
    InterruptionConfig,
    SamplerConfig,
    check_sampling,
    check_thinking_budget,
)
from jaxrl_scale.hosts.config import HostsConfig
from jaxrl_scale.models.config import (
    LORA_GROUPS,
    LORA_TARGETS,
    LoRAConfig,
    ModelConfig,
    RopeScalingConfig,
)
from jaxrl_scale.parallel.config import DistributedConfig, MeshConfig
from jaxrl_scale.rl.config import (
    CheckpointConfig,
    CurriculumConfig,
    LogConfig,
    LossConfig,
    OptimConfig,
    PipelineConfig,
    TrainConfig,
    WarmStartConfig,
)
from jaxrl_scale.tasks.config import ArithmeticConfig, CountdownConfig, MathConfig, TaskConfig

__all__ = [
    "ASSET", "ArithmeticConfig", "CheckpointConfig", "ConfigError", "CountdownConfig",
    "CurriculumConfig", "DType", "DistributedConfig", "ExperimentConfig", "ForecastConfig",
    "HostsConfig", "InterruptionConfig", "LORA_GROUPS", "LORA_TARGETS", "LoRAConfig",
    "LogConfig", "LossConfig", "MathConfig", "MeshConfig", "ModelConfig", "OptimConfig",
    "PipelineConfig", "RopeScalingConfig", "SamplerConfig", "TaskConfig", "TrainConfig",
    "WarmStartConfig",
    "apply_overrides", "asset_path", "check_sampling", "check_thinking_budget", "dump_config",
    "from_dict", "load_config", "parse_override", "resolve_paths", "to_dict",
]  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    seed: int = 0
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    sampler: SamplerConfig = dataclasses.field(default_factory=SamplerConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    warm_start: WarmStartConfig = dataclasses.field(default_factory=WarmStartConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    curriculum: CurriculumConfig = dataclasses.field(default_factory=CurriculumConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    forecast: ForecastConfig = dataclasses.field(default_factory=ForecastConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    hosts: HostsConfig = dataclasses.field(default_factory=HostsConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)

    def __post_init__(self):
        if self.hosts.generator_groups:
            require(self.pipeline.mode != "ppo_off_policy", "pipeline.mode",
                     "ppo_off_policy is not run across hosts (hosts.generator_groups): use "
                     "pipeline_rl or sync")  # fmt: skip
            require(
                not self.pipeline.generator_devices,
                "pipeline.generator_devices",
                "must be 0 when generators are jobs of their own (hosts.generator_groups)",
            )
            require(
                self.pipeline.mode == "sync" or self.pipeline.max_staleness >= 1,
                "pipeline.max_staleness",
                "must be >= 1 in pipeline_rl across hosts",
            )
        x, e = self.mesh.expert, self.model.num_experts
        require(
            x in (-1, 1) or self.model.init_from is not None or (e and e % x == 0),
            "mesh.expert",
            f"{x} expert shards need an MoE policy whose model.num_experts is a multiple of "
            f"{x}, got {e}",
        )
        slots, g = self.sampler.slots, self.train.group_size
        require(
            not slots or slots >= g,
            "sampler.slots",
            f"{slots} cannot hold one group of train.group_size = {g} rows",
        )

    @property
    def batching(self) -> str:
        """`sampler.batching` with "auto" resolved: continuous in pipeline_rl, where the engine
        refills a finished row's slot from the batch queued next while the trainer trains;
        static in sync and ppo_off_policy, whose rounds are admitted whole and drained, so
        with slots >= a round's rows the engine would decode the same schedule with more host
        round trips (with fewer slots, `continuous` refills them within the round)."""
        if self.sampler.batching != "auto":
            return self.sampler.batching
        return "continuous" if self.pipeline.mode == "pipeline_rl" else "static"


# --------------------------------------------------------------------------- YAML plumbing

OPTIM_KEYS = tuple(f.name for f in dataclasses.fields(OptimConfig))


def _resolve(path: str | Path, relative_to: Path | None = None) -> Path:
    if str(path).startswith(ASSET):
        return asset_path(str(path))
    path = Path(path)
    return path if relative_to is None else relative_to / path


def _dataclass_of(tp: Any) -> type | None:
    """The dataclass inside `tp` (also `X | None`), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        return inner[0] if len(inner) == 1 else None
    return None


# Keys that moved to their own section: a config written for the old layout gets the new name.
MOVED = {
    **{f"train.{k}": f"optim.{k}" for k in OPTIM_KEYS},
    "train.sft_steps": "warm_start.steps",
    "train.sft_target_loss": "warm_start.target_loss",
    "train.sft_batch_size": "warm_start.batch_size",
    "train.sft_learning_rate": "warm_start.optim.learning_rate",
    **{f"task.{k}": f"task.arithmetic.{k}" for k in ("max_digits", "ops", "demo_noise")},
    **{f"task.{k}": f"task.countdown.{k}" for k in ("numbers", "max_number", "max_target")},
    **{
        f"task.{k}": f"task.math.{k}"
        for k in ("data", "eval_data", "question_key", "answer_key", "template", "verify_timeout")
    },
}


def _check_keys(cls: type, data: Mapping[str, Any], prefix: str) -> None:
    """Raise for any key in `data` that `cls` lacks, suggesting the closest valid one."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in names and dotted in MOVED:
            raise ConfigError(f"config key '{dotted}' is now '{MOVED[dotted]}'")
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
            cls,
            dict(data),
            config=dacite.Config(strict=True, type_hooks={float: _to_float}, cast=[tuple]),
        )
    except dacite.WrongTypeError as e:
        key = f"{prefix}{e.field_path}"
        raise ConfigError(f"{key}: expected {_type_name(e.field_type)}, got {e.value!r}") from None
    except dacite.DaciteError as e:
        raise ConfigError(f"{prefix or 'config'}: {e}") from None


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:  # name the choices, not the type
        return "one of " + ", ".join(repr(v) for v in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):  # e.g. bool | Literal["auto"]
        return " or ".join(
            "true or false" if a is bool else "null" if a is type(None) else _type_name(a)
            for a in typing.get_args(tp)
        )
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


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, section by section."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """One YAML file as a dict; a top-level `base: other.yaml` (relative to this file) is read
    first and this file's keys override it, so an ablation arm states only what it changes."""
    path = path.resolve()
    if path in chain:
        raise ConfigError(f"{path}: 'base' files include each other: {[str(p) for p in chain]}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base: expected a path to a YAML file, got {base!r}")
    return _merge(_read_yaml(_resolve(base, path.parent), (*chain, path)), data)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Read YAML `path` (or start from defaults), following `base:` files, and apply dotted
    overrides. `asset:NAME` (as `path` or as a `base:`) is a config shipped in the package."""
    data = _read_yaml(_resolve(path)) if path is not None else {}
    return from_dict(ExperimentConfig, apply_overrides(data, overrides))


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_config(cfg: ExperimentConfig, header: str = "") -> str:
    """`cfg` as YAML that `load_config` reads back into an equal config; `header` lines become
    comments at the top."""
    comments = "".join(f"# {line}\n" for line in header.splitlines())
    return comments + yaml.safe_dump(to_dict(cfg), sort_keys=False)


def resolve_paths(cfg: ExperimentConfig, cwd: str | Path | None = None) -> ExperimentConfig:
    """`cfg` with its relative file paths made absolute (against `cwd`, default the current
    directory), so that the config a run writes (RUN/config.yaml) reruns from anywhere: the
    data files of task.math / task.code, model.init_from and model.lora.init_from, and any
    string in task.args (and a mixture's args) that names an existing file or folder. Names
    that are not files here (a Hugging Face dataset, `asset:...`) stay as they are."""
    base = Path.cwd() if cwd is None else Path(cwd)

    def path(value: Any) -> Any:
        if not isinstance(value, str) or not value or value.startswith(ASSET):
            return value
        p = Path(value).expanduser()
        if p.is_absolute() or not (base / p).exists():
            return value
        return str((base / p).resolve())

    def args(tree: Any) -> Any:
        if isinstance(tree, Mapping):
            return {k: args(v) for k, v in tree.items()}
        if isinstance(tree, list | tuple):
            return type(tree)(args(v) for v in tree)
        return path(tree)

    t, m = cfg.task, cfg.model
    task = dataclasses.replace(
        t,
        args=args(t.args),
        mixture=tuple(dataclasses.replace(c, args=args(c.args)) for c in t.mixture),
        math=dataclasses.replace(t.math, data=path(t.math.data), eval_data=path(t.math.eval_data)),
        code=dataclasses.replace(t.code, data=path(t.code.data), eval_data=path(t.code.eval_data)),
    )
    model = dataclasses.replace(
        m,
        init_from=path(m.init_from),
        lora=dataclasses.replace(m.lora, init_from=path(m.lora.init_from)),
    )
    return dataclasses.replace(cfg, task=task, model=model)
