"""The matmul every projection of the policy runs (base kernels and LoRA adapters alike)."""

from __future__ import annotations

import math

import jax.numpy as jnp


def dense(x, kernel, n_in: int = 1, precision=None):
    """x [..., in] @ kernel [*in_dims (n_in of them), *out_dims] -> [..., *out_dims].

    Written as one 2-D matmul over flattened leading axes: XLA's CPU backend runs the backward
    pass of a 3-D `[B, T, D] @ [D, F]` dot about 3x slower than the same 2-D one.
    """
    in_shape, out_shape = kernel.shape[:n_in], kernel.shape[n_in:]
    lead = x.shape[: x.ndim - n_in]
    x2 = x.reshape(math.prod(lead), math.prod(in_shape))
    k2 = kernel.reshape(math.prod(in_shape), math.prod(out_shape))
    return jnp.matmul(x2, k2, precision=precision).reshape(*lead, *out_shape)
