"""Device meshes from config, logical-axis -> mesh-axis rules, and sharded placement.

Model code names logical axes only (`logical_axes` metadata on each parameter); this table is
the one place that says where they live on the ("data", "fsdp", "expert", "tensor") mesh. The
run's meshes (trainer, and generator when it has devices of its own), the train state's and
the batch's layouts and the checks that batches split evenly over them are here too.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxrl_scale.configbase import ConfigError
from jaxrl_scale.parallel.config import MeshConfig

if TYPE_CHECKING:  # the root config composes every part's section
    from jaxrl_scale.config import ExperimentConfig


MESH_AXES = ("data", "fsdp", "expert", "tensor")

LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    # Rows split over "expert" too: outside MoE layers an expert shard is one more data shard
    # (moe.py gathers its rows to the experts it holds and scatters the outputs back).
    "batch": ("data", "fsdp", "expert"),
    "vocab": "tensor",
    # On an FSDP mesh (fsdp > 1) an expert shard is one more FSDP shard outside the experts'
    # matrices, so attention, embeddings and their optimizer moments split over every device
    # of an fsdp x expert mesh; on a mesh without FSDP (a generator's) they stay whole, and a
    # decode step gathers none (`variable_sharding`; an expert kernel's own "expert" axis
    # takes that mesh axis first).
    "embed": ("fsdp", "expert"),
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "expert": "expert",  # an MoE layer's experts (moe.py): E / |expert| on each expert shard
    "norm": None,
    "lora": None,  # an adapter's rank axis (lora.py): small, replicated
}


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, expert, tensor) mesh with Auto axis types over `devices` (default: all).
    With -1 on an axis the mesh spans every device; a fully specified shape that asks for fewer
    devices than there are takes the first ones (e.g. one device for a small run)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = [cfg.data, cfg.fsdp, cfg.expert, cfg.tensor]
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if len(devices) % known:
            raise ConfigError(f"mesh: {len(devices)} devices do not divide into axes {shape}")
        shape[shape.index(-1)] = len(devices) // known
    if math.prod(shape) < len(devices):
        devices = devices[: math.prod(shape)]
    if math.prod(shape) != len(devices):
        raise ConfigError(
            f"mesh: shape data={shape[0]} fsdp={shape[1]} expert={shape[2]} "
            f"tensor={shape[3]} needs {math.prod(shape)} devices, have {len(devices)}"
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
        return replicated(mesh)
    spec = logical_to_spec(axes)
    shape = variable.get_value().shape
    fixed, used = [], set()
    for dim, names in zip(shape, spec, strict=True):
        names_t = (names,) if isinstance(names, str) else (names or ())
        # A mesh axis splits one dimension at most (an earlier one keeps it), a size-1 axis
        # beside others adds nothing, and trailing axes that do not divide the dimension
        # evenly are let go (e.g. 2 kv-heads over tensor=4 stay whole).
        names_t = [n for n in names_t if n not in used]
        if "fsdp" in names_t and mesh.shape["fsdp"] == 1:
            names_t = [n for n in names_t if n != "expert"]
        if len(names_t) > 1:
            names_t = [n for n in names_t if mesh.shape[n] > 1] or names_t[:1]
        while names_t and dim % math.prod(mesh.shape[n] for n in names_t):
            names_t.pop()
        used.update(names_t)
        fixed.append(None if not names_t else names_t[0] if len(names_t) == 1 else tuple(names_t))
    return NamedSharding(mesh, PartitionSpec(*fixed))


def state_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    """NamedSharding for every variable of `state` (abstract or concrete), from its logical axes."""

    def one(x):
        if isinstance(x, nnx.Variable):
            return x.replace(variable_sharding(x, mesh))
        return replicated(mesh)

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def init_sharded(
    make_module: Callable[[nnx.Rngs], nnx.Module], mesh: Mesh, seed: int
) -> nnx.Module:
    """`make_module(nnx.Rngs(params=seed))`, built sharded. Shapes first: eval_shape ->
    shardings -> jit(init, out_shardings), so parameters are created already sharded and a
    model too big for one device never lands on one. The seed's key is the program's argument,
    not a constant in it: every seed runs one program (cached across runs and processes)."""

    def make(key):
        return make_module(nnx.Rngs(params=key))

    key = jax.random.key(seed)
    abstract = nnx.eval_shape(make, key)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = state_shardings(abstract_state, mesh)
    state = jax.jit(lambda key: nnx.state(make(key)), out_shardings=shardings)(key)
    return nnx.merge(graphdef, state)


def shard_module(module: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Move an existing module's variables onto `mesh` according to their logical axes."""
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, jax.device_put(state, state_shardings(state, mesh)))


def traced_on(mesh: Mesh | None):
    """The context a program's body is traced in so that model code sees `mesh`'s axes
    (activations' rows pinned to the batch axes, each MoE layer run per shard with its
    experts where they live): the abstract mesh, or nothing without one."""
    if mesh is None:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def constrain_rows(x):
    """An activation's rows split over the batch axes of the mesh being traced under
    (`jax.set_mesh`, as the train step is), when they divide evenly; outside one, x as is.

    The partitioner left alone may keep an FSDP layer's activations whole on every device and
    shard them along the model dimension instead (each device then runs every row); this
    pins the data-parallel layout at each layer boundary."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = None if mesh.empty else row_axes(mesh, x.shape[0])
    if axes is None:
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(axes, *([None] * (x.ndim - 1))))


def row_axes(mesh, rows: int) -> tuple[str, ...] | None:
    """The mesh's batch axes, when they split `rows` evenly (else None: rows stay whole)."""
    axes = tuple(a for a in LOGICAL_RULES["batch"] if a in mesh.axis_names)
    if not axes or rows % math.prod(mesh.shape[a] for a in axes):
        return None
    return axes


def batch_ways(mesh: Mesh | None) -> int:
    """How many shards the mesh's batch axes split a batch's rows (or the generator's slots)
    into; 1 without a mesh."""
    if mesh is None:
        return 1
    return math.prod(mesh.shape[a] for a in LOGICAL_RULES["batch"] if a in mesh.axis_names)


def replicated(mesh: Mesh) -> NamedSharding:
    """A full copy on every device of `mesh`."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Leading axis over the batch mesh axes, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(LOGICAL_RULES["batch"], *([None] * (ndim - 1))))


def batch_shardings(tree, mesh: Mesh):
    """A sharding for every leaf of a batch-like tree (arrays or shapes with a leading batch
    axis), from the leaf's rank: rows over the batch axes, the rest replicated."""
    return jax.tree.map(lambda x: batch_sharding(mesh, np.ndim(x) if np.ndim(x) else 1), tree)


def train_state_shardings(state, mesh: Mesh):
    """A train state's layout: parameters (and the optimizer moments that mirror them) where
    their logical axes put them on `mesh` (they were created there); everything else
    (counters, scalars) replicated."""

    def one(x):
        s = getattr(x, "sharding", None)
        ok = isinstance(s, NamedSharding) and s.mesh == mesh
        return s if ok else replicated(mesh)

    return jax.tree.map(one, state)


def make_meshes(cfg: ExperimentConfig, *, processes: int | None = None) -> tuple[Mesh, Mesh | None]:
    """(trainer mesh, generator mesh or None): `pipeline.generator_devices` takes the last
    devices for generation (batch-parallel, with the trainer's tensor axis; a mixture of
    experts' generator also splits its experts over every batch shard, the rest whole) and
    leaves the rest,
    shaped by `mesh`, to the trainer. Across processes every process gives its last
    generator_devices / processes devices, so each holds devices of both meshes.
    `processes` (the memory planner, on one process's fake devices): split the devices into
    that many consecutive blocks, each standing for a process, and apply the same rules."""
    g = cfg.pipeline.generator_devices
    devices = jax.devices()
    if processes is not None and len(devices) % processes:
        raise ConfigError(
            f"--processes: {len(devices)} devices do not split over {processes} processes"
        )
    if g == 0:
        return make_mesh(cfg.mesh), None
    if g >= len(devices):
        raise ConfigError(
            f"pipeline.generator_devices: {g} leaves no device for training "
            f"(there are {len(devices)})"
        )
    tensor = cfg.mesh.tensor if cfg.mesh.tensor > 0 else 1
    if g % tensor:
        raise ConfigError(
            f"pipeline.generator_devices: {g} is not a multiple of mesh.tensor={tensor}"
        )
    per_process: dict[int, list] = {}
    block = len(devices) // processes if processes else 0
    for i, d in enumerate(devices):
        per_process.setdefault(i // block if block else d.process_index, []).append(d)
    n = len(per_process)
    if g % n or g // n >= min(len(ds) for ds in per_process.values()):
        raise ConfigError(
            f"pipeline.generator_devices: {g} must take the same number of devices from each "
            f"of the {n} processes and leave each some to train with (whole hosts that only "
            "generate are not supported)"
        )
    take = g // n
    gen = [d for p in sorted(per_process) for d in per_process[p][-take:]]
    train = [d for p in sorted(per_process) for d in per_process[p][:-take]]
    ways = g // tensor
    # A mixture of experts' generator splits its experts over all its batch shards where they
    # divide (each device holds E / ways experts and every other weight whole), else none.
    expert = ways if cfg.model.num_experts and cfg.model.num_experts % ways == 0 else 1
    gen_mesh = make_mesh(MeshConfig(data=ways // expert, fsdp=1, expert=expert, tensor=tensor), gen)
    return make_mesh(cfg.mesh, train), gen_mesh


def check_divisible(cfg: ExperimentConfig, mesh: Mesh, gen_mesh: Mesh | None) -> None:
    """Batches split evenly over the batch axes of the meshes they live on."""
    batch = cfg.train.prompts_per_step * cfg.train.group_size
    checks = [("train.prompts_per_step x train.group_size", batch, mesh, "mesh")]
    if gen_mesh is not None:  # (held-out waves are filled up to split: rollout.wave_prompts)
        checks.append(("train.prompts_per_step x train.group_size", batch, gen_mesh, "generator"))
    if cfg.sampler.slots and cfg.batching == "continuous":  # the engine's slots split like a
        # batch's rows (else every device would hold and decode every slot); static waves are
        # sized to split (rollout.wave_prompts)
        checks.append(("sampler.slots", cfg.sampler.slots, gen_mesh or mesh, "generator"))
    for name, size, m, where in checks:
        ways = batch_ways(m)
        if size % ways:
            raise ConfigError(
                f"{name}: {size} does not split over the {where}'s {ways} batch shards"
            )
