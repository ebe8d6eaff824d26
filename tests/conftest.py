"""Eight fake CPU devices for every test; must run before jax is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA compilation cache per test session (a fresh folder each run, inherited by
# the subprocesses the tests start): the many small runs compile the same programs again.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _CACHE_DIR = tempfile.mkdtemp(prefix="jaxrl-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
else:
    _CACHE_DIR = None
# This process itself does not write the cache: in the full suite jax 0.10.2 crashed
# (segfault) serialising an executable into it, deterministically, after some hundreds of
# entries; the subprocesses the tests start (few programs each) still share it.
import jax  # noqa: E402

jax.config.update("jax_enable_compilation_cache", False)

from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
HF_FIXTURES = FIXTURES / "hf"
ROOT = Path(__file__).parent.parent
TINY_CONFIG = ROOT / "configs" / "tiny_arithmetic.yaml"
# Overrides that shrink the tiny config to seconds per run, every switch kept.
FAST = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_layers=1",
    "task.arithmetic.max_digits=1",
    "task.num_train=64",
    "task.num_eval=8",
    "train.prompts_per_step=4",
    "train.group_size=4",
    "train.steps=3",
    "train.eval_every=2",
    "train.eval_samples=2",
    "warm_start.steps=2",
    "sampler.max_new_tokens=4",
    "checkpoint.every=0",
    "mesh.data=1",
]


def pytest_sessionfinish(session, exitstatus):
    if _CACHE_DIR is not None:
        import shutil

        shutil.rmtree(_CACHE_DIR, ignore_errors=True)


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
