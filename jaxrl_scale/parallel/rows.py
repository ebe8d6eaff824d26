"""A model version as rows: every leaf flattened, padded and seen as `[rows, chunk]`, split over
a 1-D mesh of devices. The layout weights cross between jobs in (hosts/weights.py), chosen
so that any two device counts dividing `rows` split it into whole blocks; the trainer's program
that makes it is planned by the memory planner (memory/hosts.py)."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "rows"


def rows_mesh(devices) -> Mesh:
    return Mesh(np.asarray(devices), (AXIS,))


def to_rows(x, rows: int):
    flat = x.reshape(-1)
    chunk = -(-flat.size // rows)
    return jnp.pad(flat, (0, rows * chunk - flat.size)).reshape(rows, chunk)


def from_rows(r, shape):
    return r.reshape(-1)[: math.prod(shape)].reshape(shape)


def layout_program(mesh: Mesh, rows: int, cast: Callable):
    """The program that lays a version out on `mesh`'s devices: `cast(params)` (the dtypes the
    generator decodes with), each leaf as `[rows, chunk]` split over the devices in order."""
    target = NamedSharding(rows_mesh(mesh.devices.flat), PartitionSpec(AXIS))

    def layout(params):
        return [to_rows(x, rows) for x in jax.tree.leaves(cast(params))]

    return jax.jit(layout, out_shardings=target)
