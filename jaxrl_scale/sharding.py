"""Device mesh from config, logical-axis -> mesh-axis rules, and sharded placement.

Model code names logical axes only (`logical_axes` metadata on each parameter); this table is the
one place that says where they live on the ("data", "fsdp", "tensor") mesh.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxrl_scale.config import ConfigError, MeshConfig

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
}


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh with Auto axis types over `devices` (default: all). With -1
    on an axis the mesh spans every device; a fully specified shape that asks for fewer devices
    than there are takes the first ones (e.g. one device for a small run)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = [cfg.data, cfg.fsdp, cfg.tensor]
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if len(devices) % known:
            raise ConfigError(f"mesh: {len(devices)} devices do not divide into axes {shape}")
        shape[shape.index(-1)] = len(devices) // known
    if math.prod(shape) < len(devices):
        devices = devices[: math.prod(shape)]
    if math.prod(shape) != len(devices):
        raise ConfigError(
            f"mesh: shape data={shape[0]} fsdp={shape[1]} tensor={shape[2]} needs "
            f"{math.prod(shape)} devices, have {len(devices)}"
        )
    device_grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(device_grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(axes: Sequence[str | None]) -> PartitionSpec:
    try:
        return PartitionSpec(*(LOGICAL_RULES[a] if a is not None else None for a in axes))
    except KeyError as e:
        raise ValueError(f"no sharding rule for logical axis {e.args[0]!r}") from None


def variable_sharding(variable: nnx.Variable, mesh: Mesh) -> NamedSharding:
    """Where one parameter lives on `mesh`, from its `logical_axes` metadata."""
    axes = variable.get_metadata().get("logical_axes")
    if axes is None:
        return NamedSharding(mesh, PartitionSpec())
    spec = logical_to_spec(axes)
    shape = variable.get_value().shape
    # An axis that does not divide evenly (e.g. 2 kv-heads over tensor=4) stays replicated.
    fixed = []
    for dim, names in zip(shape, spec, strict=True):
        names_t = (names,) if isinstance(names, str) else (names or ())
        size = math.prod(mesh.shape[n] for n in names_t)
        fixed.append(names if dim % size == 0 else None)
    return NamedSharding(mesh, PartitionSpec(*fixed))


def state_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    """NamedSharding for every variable of `state` (abstract or concrete), from its logical axes."""

    def one(x):
        if isinstance(x, nnx.Variable):
            return x.replace(variable_sharding(x, mesh))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def init_sharded(make_module: Callable[[], nnx.Module], mesh: Mesh) -> nnx.Module:
    """Shapes first: eval_shape -> shardings -> jit(init, out_shardings), so parameters are
    created already sharded and a model too big for one device never lands on one."""
    abstract = nnx.eval_shape(make_module)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = state_shardings(abstract_state, mesh)
    state = jax.jit(lambda: nnx.state(make_module()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def shard_module(module: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Move an existing module's variables onto `mesh` according to their logical axes."""
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, jax.device_put(state, state_shardings(state, mesh)))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Leading axis over the batch mesh axes, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(LOGICAL_RULES["batch"], *([None] * (ndim - 1))))
