"""The ground every configuration section stands on: the error that names a dotted key, the
check that raises it, the dtype names, and the files shipped in the package's assets."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

DType = Literal["float32", "bfloat16"]
ASSET = "asset:"  # names a file shipped in jaxrl_scale/assets (e.g. asset:demo.yaml)


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the dotted key."""


def require(ok: bool, key: str, message: str) -> None:
    """Raise a ConfigError naming `key` unless `ok`."""
    if not ok:
        raise ConfigError(f"{key}: {message}")


def asset_path(name: str) -> Path:
    """The path of a file or folder shipped in the package's assets."""
    return Path(__file__).resolve().parent / "assets" / name.removeprefix(ASSET)
