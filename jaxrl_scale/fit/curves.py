"""Compute-performance curves as pure array functions (broadcasting over every argument)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sigmoid(c, a, b, c_mid, r0):
    """ScaleRL's curve R(C) = r0 + (a - r0) / (1 + (c_mid / C) ** b).

    Computed as r0 + (a - r0) * logistic(b * (ln C - ln c_mid)), which is the same function
    without overflow for large (c_mid / C) ** b.
    """
    c, c_mid = jnp.asarray(c), jnp.asarray(c_mid)
    return r0 + (a - r0) * jax.nn.sigmoid(b * (jnp.log(c) - jnp.log(c_mid)))


def power_law(c, a, d, b):
    """The rejected alternative R(C) = a - d * C ** (-b)."""
    return a - d * jnp.asarray(c) ** (-b)
