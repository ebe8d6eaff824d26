"""The check `train` makes at setup: a run whose train step or generator the memory plan says
does not fit its devices is refused before anything of the run compiles, with the plan's
numbers and what to change, in place of a `RESOURCE_EXHAUSTED` minutes later.

A plan compiles the run's programs from shapes (seconds for a small model, a minute for an
8B one), so the check first screens: a rough per-device size from the config's numbers alone
(parameters and Adam's state, a micro-batch's activations, attention scores and logits chunk,
the KV cache), written to err high. Below a quarter of the pool the run goes on without a
plan; above it, the plan decides. `train.check_memory: false` skips both.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import jax

from jaxrl_scale.configbase import ConfigError
from jaxrl_scale.memory.abstract import GIB

if TYPE_CHECKING:
    from jaxrl_scale.config import ExperimentConfig

SCREEN_SHARE = 0.25  # the plan runs when the rough size passes this share of the pool


def pool_bytes(devices: int | None = None) -> tuple[int, str]:
    """(bytes JAX can use on one device, what that number is): an accelerator's pool as its
    runtime reports it; on CPU the host's available memory, shared by the `devices` the run
    uses (default: every local device)."""
    device = jax.local_devices()[0]
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - some backends do not implement memory_stats
        limit = None
    if limit:
        return int(limit), f"{device.device_kind} pool"
    available = _host_available()
    n = min(devices or jax.local_device_count(), jax.local_device_count())
    share = f" over {n} CPU devices" if n > 1 else ""
    return available // n, f"host memory available ({available / GIB:.1f} GiB{share})"


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def rough_bytes(cfg: ExperimentConfig, prompt_len: int) -> int:
    """A rough per-device size of the run's largest program, from the config's numbers alone
    (meant to err high): the train step's state and a micro-batch's activations, attention
    scores and logits chunk in every layer at once, or the generator's KV cache."""
    m, t, s = cfg.model, cfg.train, cfg.sampler
    devices = max(1, jax.device_count() - cfg.pipeline.generator_devices)
    budget = cfg.task.max_episode_tokens if cfg.task.max_turns > 1 else s.max_new_tokens
    seq = prompt_len + budget
    d, layers, e = m.hidden_size, m.num_layers, m.resolved_head_dim
    kv = m.num_kv_heads * e
    mlp = m.moe_intermediate_size * m.num_experts if m.num_experts else m.intermediate_size
    per_layer = d * (2 * m.num_heads * e + 2 * kv) + 3 * d * mlp
    params = m.vocab_size * d * (1 if m.tie_embeddings else 2) + layers * per_layer
    state = 16 * params / devices  # float32 parameters, gradients and Adam's two moments
    rows = t.prompts_per_step * t.group_size / t.micro_batches / devices
    block = seq if m.attention == "xla" else min(seq, m.attention_block_size)
    activations = layers * seq * (16 * d + 4 * m.num_heads * block)
    logits = 8 * min(seq, m.logits_chunk_size) * m.vocab_size
    train = state + rows * (activations + logits)
    slots = s.slots or t.prompts_per_step * t.group_size
    gen_devices = cfg.pipeline.generator_devices or devices
    cache = slots / gen_devices * seq * layers * 2 * kv * 4
    return int(max(train, cache))


def check_fits(cfg: ExperimentConfig, prompt_len: int, devices: int | None = None) -> None:
    """Refuse (ConfigError) a config the memory plan says does not fit this machine's devices;
    `prompt_len`: the run's widest prompt in tokens; `devices`: how many this process's run
    uses. `train.check_memory: false` skips it."""
    if not cfg.train.check_memory:
        return
    pool, where = pool_bytes(devices)
    if rough_bytes(cfg, prompt_len) < SCREEN_SHARE * pool:
        return
    from jaxrl_scale.memory.plan import plan

    print(f"memory: planning the run's programs against the {where} ...", flush=True)
    report = plan(
        cfg,
        prompt_len=max(1, prompt_len),
        device_memory_gib=pool / GIB,
        mem_fraction=1.0,
        say=lambda text: print(f"memory: {text}", flush=True),
    )
    if report["fits"]:
        return
    lines = [
        f"  {name.replace('_', ' ')}: {_gib(part['per_device_bytes'])} per device; {part['advice']}"
        for name, part in report.items()
        if isinstance(part, dict) and part.get("fits") is False
    ]
    raise ConfigError(
        f"the memory plan says this run does not fit its devices ({_gib(pool)} per device: the "
        f"{where}), sequences of {report['sequence_length']:,} tokens:\n" + "\n".join(lines) +
        "\n(`jaxrl-scale memory --config ...` prints the whole plan; train.check_memory: false "
        "runs anyway)"
    )  # fmt: skip


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"
