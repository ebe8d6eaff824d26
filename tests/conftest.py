"""Eight fake CPU devices for every test; must run before jax is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
HF_FIXTURES = FIXTURES / "hf"
ROOT = Path(__file__).parent.parent


@pytest.fixture
def tiny_model_config():
    """The demo's model config: tests use a tiny variant of the real default."""
    from jaxrl_scale.config import load_config

    return load_config(ROOT / "configs" / "demo.yaml").model
