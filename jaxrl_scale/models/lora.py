"""Low-rank adapters (LoRA) on the decoder's projections: the trainable part of a LoRA policy.

A targeted kernel W [*in, *out] gains A [*in, r] and B [r, *out] (`LoRAParam`s, beside W in the
same module) and the projection computes x W + s (x A) B, s = alpha / r (PEFT's rule; alpha /
sqrt(r) with rslora). B starts at zero, so the adapted policy starts equal to its base.

How a run holds it. `split_policy(model)` -> (graphdef, frozen, trainable): with LoRA on,
`trainable` is the adapters alone (what gets gradients, optimizer state, checkpoints and what
the generator receives on each update) and `frozen` the base, stored once in
`model.lora.base_dtype` and never donated, so the train step and an in-process generator read
the same buffers; with LoRA off, `frozen` is None and `trainable` is every parameter, as before.
`merge_params(frozen, trainable)` is the full parameter state a module is rebuilt from (no copy).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_scale.models.config import LORA_TARGETS, ModelConfig
from jaxrl_scale.models.layers import dense

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# PEFT module name -> (the module holding it: "attn" / "mlp", our kernel's prefix).
PROJECTIONS = {
    "q_proj": ("attn", "q"),
    "k_proj": ("attn", "k"),
    "v_proj": ("attn", "v"),
    "o_proj": ("attn", "o"),
    "gate_proj": ("mlp", "gate"),
    "up_proj": ("mlp", "up"),
    "down_proj": ("mlp", "down"),
}
assert tuple(PROJECTIONS) == LORA_TARGETS


class LoRAParam(nnx.Param):
    """An adapter matrix (A or B): the only trainable weights of a LoRA policy."""


def adapter_pair(kernel_shape, kernel_axes, n_in: int, rank: int):
    """Zero-valued (A [*in, r], B [r, *out]) for a kernel of `kernel_shape` whose first `n_in`
    axes are its input; `init_adapters` draws A once the whole model exists."""
    a = LoRAParam(
        jnp.zeros((*kernel_shape[:n_in], rank), jnp.float32),
        logical_axes=(*kernel_axes[:n_in], "lora"),
    )
    b = LoRAParam(
        jnp.zeros((rank, *kernel_shape[n_in:]), jnp.float32),
        logical_axes=("lora", *kernel_axes[n_in:]),
    )
    return a, b


def delta(module, name: str, x, *, n_in: int, precision, scale: float):
    """s (x A) B for `module`'s `name` projection, or None where it has no adapter."""
    a = getattr(module, f"{name}_lora_a", None)
    if a is None:
        return None
    b = getattr(module, f"{name}_lora_b")
    dtype = x.dtype
    xa = dense(x, a[...].astype(dtype), n_in=n_in, precision=precision)
    return dense(xa, b[...].astype(dtype), precision=precision) * jnp.asarray(scale, dtype)


def adapted_modules(model):
    """(layer index, PEFT projection name, module, our prefix) for every adapter of `model`."""
    for i, layer in enumerate(model.layers):
        for proj, (where, prefix) in PROJECTIONS.items():
            module = getattr(layer, where)
            if hasattr(module, f"{prefix}_lora_a"):
                yield i, proj, module, prefix


def init_adapters(model, key) -> None:
    """Draw every A from U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (PEFT's kaiming-uniform default)
    with one key taken after the base's, so a LoRA policy's base equals the rank-0 policy's
    of the same seed. B stays 0."""
    for n, (_, _, module, prefix) in enumerate(adapted_modules(model)):
        a = getattr(module, f"{prefix}_lora_a")
        shape = a.get_value().shape
        bound = 1.0 / math.sqrt(math.prod(shape[:-1]))
        value = jax.random.uniform(jax.random.fold_in(key, n), shape, jnp.float32, -bound, bound)
        a.set_value(value)


# --------------------------------------------------------------------------- the run's split


def is_base_matrix(path, var) -> bool:
    """A decoder layer's projection kernel (what `base_dtype` narrows): not a norm, a bias,
    an adapter, the embedding, the head (the FP32 head keeps its float32 kernel) or an MoE
    router (float32 logits: moe.py)."""
    names = [getattr(p, "key", p) for p in path]
    return (
        names[0] == "layers"
        and not isinstance(var, LoRAParam)
        and str(names[-1]).endswith("_kernel")
        and names[-1] != "router_kernel"
    )


def split_policy(model, cfg: ModelConfig):
    """(graphdef, frozen base or None, trainable state); see the module docstring."""
    if not cfg.lora.enabled:
        graphdef, params = nnx.split(model)
        return graphdef, None, params
    graphdef, adapters, base = nnx.split(model, LoRAParam, ...)
    dtype = _DTYPES[cfg.lora.base_dtype]

    def narrow(path, var):
        if is_base_matrix(path, var) and var.get_value().dtype != dtype:
            return var.replace(var.get_value().astype(dtype))
        return var

    base = jax.tree_util.tree_map_with_path(
        narrow, base, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return graphdef, base, adapters


def merge_params(frozen, trainable):
    """The full parameter state (base and adapters; no copy), or `trainable` without LoRA."""
    return trainable if frozen is None else nnx.merge_state(frozen, trainable)


def merge_policy(graphdef, trainable, frozen=None):
    """The module of `trainable` on top of `frozen`."""
    if frozen is None:
        return nnx.merge(graphdef, trainable)
    return nnx.merge(graphdef, frozen, trainable)


def state_bytes(state) -> int:
    """Bytes of every array in `state` (abstract or concrete)."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))


def fingerprint(state) -> np.ndarray:
    """[leaves, 2] float64: each array's sum and sum of squares (in float32), what a LoRA
    checkpoint records of the base its adapters were trained on (`same_base` compares)."""
    sums = [
        (jnp.sum(x.astype(jnp.float32)), jnp.sum(jnp.square(x.astype(jnp.float32))))
        for x in jax.tree.leaves(state)
    ]
    return np.asarray(jax.device_get(sums), np.float64).reshape(-1, 2)


def same_base(saved: np.ndarray, current: np.ndarray) -> bool:
    """Whether two fingerprints are of the same base (up to the reduction order of another
    device layout)."""
    return saved.shape == current.shape and bool(np.allclose(saved, current, rtol=1e-4, atol=1e-6))


# --------------------------------------------------------------------------- merging


def merged_kernel(kernel, a, b, scale: float) -> np.ndarray:
    """W + s A B in float32 for a kernel [*in, *out] and its adapters (host arrays)."""
    kernel = np.asarray(kernel, np.float32)
    a2 = np.asarray(a, np.float32).reshape(-1, a.shape[-1])
    b2 = np.asarray(b, np.float32).reshape(b.shape[0], -1)
    return kernel + (scale * (a2 @ b2)).reshape(kernel.shape)
