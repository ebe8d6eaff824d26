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
    """A small Qwen2-shaped policy for model tests (tests vary it with dataclasses.replace)."""
    from jaxrl_scale.config import ModelConfig

    return ModelConfig(
        architecture="qwen2",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        qkv_bias=True,
        tie_embeddings=True,
    )
