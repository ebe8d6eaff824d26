"""Eight fake CPU devices for every test; must run before jax is imported."""

import os
import threading

# The suite's cost is compiling thousands of small programs whose run time is tiny, so the
# tests ask XLA's CPU compiler for its cheaper paths: backend optimisation level 0 and the
# classic elemental emitters in place of the MLIR fusion emitters. Measured on a tiny run
# (2-core AMD EPYC, jax 0.10.2): its XLA compiles took 6.8 s at the defaults' level 0 and
# 2.5 s with both (its train step 2.0 s -> 0.6 s); at XLA's defaults, 4.6 s for the train step
# alone. Level 0 costs the few tests that run long (code runs about half as fast: the
# bootstrap coverage test 26 s against 15 s), but without it the larger programs' compiles
# (memory plans, MoE) make the whole suite slower: 21:51 against 13:00 with both. Both change
# float results in the last bits (measured: 1e-10), which no test may depend on: results
# differ that much between processor kinds too. The processes tests start
# (several hosts on 127.0.0.1) compile with the same flags: `xla_flags`.
COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {COMPILE_FLAGS}"
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

from pathlib import Path

import pytest


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a process a test starts: `devices` fake CPU devices, the suite's level."""
    return f"--xla_force_host_platform_device_count={devices} {COMPILE_FLAGS}"


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


# The heaviest test files first (seconds of one clean-clone run on 2 workers, AMD EPYC,
# 2026-11-26): `make test` hands whole files to two workers as they free up, so a heavy file
# drawn last (alphabetically, test_multihost and test_train are late) leaves one worker idle
# while the other runs it; heaviest-first leaves the light ones to even out the end.
# test_docs.py (~150 s) stays in alphabetical order: scheduled early, beside test_hosts.py,
# its subprocess runs starved the fault soak's generator groups past their 4 s heartbeat
# (2026-11-27).
HEAVY_FIRST = (
    "test_multihost.py",  # ~200 s
    "test_memory.py",  # ~190
    "test_hosts.py",  # ~165
    "test_train.py",  # ~155
    "test_code_task.py",  # ~85
    "test_notebooks.py",  # ~70
    "test_attention.py",
    "test_moe.py",
    "test_fit_comparison.py",
    "test_lora.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest in order


def pytest_sessionfinish(session, exitstatus):
    if _CACHE_DIR is not None:
        import shutil

        shutil.rmtree(_CACHE_DIR, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module. The full suite segfaulted inside
    XLA's CPU compiler (and once while caching an executable) after some thousands of programs
    in one process, with or without the persistent cache: each program keeps its machine code
    mapped, and a process has at most vm.max_map_count (65,530 here) mappings."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


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


class Heartbeat:
    """A thread that ticks every 5 ms: the trainer's heartbeats and feeding loop stand-in."""

    def __init__(self):
        self.ticks, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self):
        while not self._stop.wait(0.005):
            self.ticks += 1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
