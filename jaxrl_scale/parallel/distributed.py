"""Multi-host runs: JAX's multi-controller runtime (`jax.distributed`), nothing home-made.

Every process runs the same program on the global mesh over all processes' devices. Where the
run's processes come from:

- explicit: `distributed.coordinator_address` ("host:port"), `num_processes`, `process_id` in
  the config, or the environment variables JAXRL_COORDINATOR, JAXRL_NUM_PROCESSES and
  JAXRL_PROCESS_ID (what launch/local_multiprocess.sh sets). The coordinator binds exactly that
  address, never a wildcard.
- detected: on a Cloud TPU slice (several workers) and under Slurm (several tasks) JAX reads the
  topology from the environment.
- otherwise: one process, and `jax.distributed` is not started.

Inside a run: process 0 alone writes metrics.jsonl, TensorBoard and fits, and reads the metrics
back on resume (other hosts need not see the run directory's files other than its checkpoints);
what it decides from them that changes the run's course (an early stop) reaches the others by
`decided_by_main`. Orbax checkpoints are
written and read by all processes together; each process places its rows of every batch with
`jax.make_array_from_process_local_data`; host-side values of sharded arrays (completions to
score) are gathered with `multihost_utils.process_allgather`; new weights reach generator
devices with `transfer`. `pipeline_rl` runs in lockstep (pipeline.py): one thread per process
issues generation and training in the same order everywhere.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxrl_scale.configbase import ConfigError
from jaxrl_scale.parallel.config import DistributedConfig

ENV = ("JAXRL_COORDINATOR", "JAXRL_NUM_PROCESSES", "JAXRL_PROCESS_ID")


def _detected_cluster() -> str | None:
    """Which multi-process environment JAX can read by itself, if any."""
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
        return "slurm"
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if len([h for h in hosts.split(",") if h]) > 1:
        return "tpu"
    return None


def settings(cfg: DistributedConfig) -> tuple[str | None, int | None, int | None]:
    """(coordinator, num_processes, process_id): the config's, else the environment's."""
    env = [os.environ.get(k) for k in ENV]
    address = cfg.coordinator_address or env[0]
    try:
        count = cfg.num_processes if cfg.num_processes is not None else _int(env[1])
        index = cfg.process_id if cfg.process_id is not None else _int(env[2])
    except ValueError as e:
        raise ConfigError(f"distributed: {e}") from None
    if address and (count is None or index is None):
        raise ConfigError(
            "distributed.coordinator_address is set: num_processes and process_id must be too "
            "(or JAXRL_NUM_PROCESSES / JAXRL_PROCESS_ID)"
        )
    if address and not 0 <= index < count:
        raise ConfigError(f"distributed.process_id: {index} is not in [0, {count})")
    return address, count, index


def _int(value: str | None) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"expected an integer, got {value!r}") from None


def initialize(cfg: DistributedConfig) -> bool:
    """Start `jax.distributed` when the run spans several processes; True if it did (or was
    already running). Call before anything touches a device."""
    if jax.distributed.is_initialized():
        return True
    address, count, index = settings(cfg)
    timeouts = dict(
        initialization_timeout=cfg.initialization_timeout,
        heartbeat_timeout_seconds=cfg.heartbeat_timeout,
    )
    if address:
        if count == 1:
            return False
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=count,
            process_id=index,
            coordinator_bind_address=address,  # bind exactly this interface and port
            **timeouts,
        )
        return True
    if _detected_cluster() is not None:
        jax.distributed.initialize(**timeouts)
        return True
    return False


def is_main() -> bool:
    """Process 0: the one that writes logs, metrics and fits."""
    return jax.process_index() == 0


def decided_by_main(decision: bool) -> bool:
    """Process 0's `decision` on every process (the others' argument is ignored): for choices
    that change which collectives run next, so that all processes take the same branch."""
    if jax.process_count() == 1:
        return bool(decision)
    return bool(multihost_utils.broadcast_one_to_all(np.int32(decision)))


def to_host(x) -> np.ndarray:
    """A jax array as numpy on this host, gathering the shards other processes hold."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def place(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """`host` (the global value, same on every process) as an array laid out by `sharding`,
    each process supplying only the rows its devices hold."""
    host = np.asarray(host)
    if jax.process_count() == 1:
        return jax.device_put(host, sharding)
    index_map = sharding.addressable_devices_indices_map(host.shape)
    blocks = sorted({(s[0].start or 0, s[0].stop or host.shape[0]) for s in index_map.values()})
    lo, hi = blocks[0][0], blocks[-1][1]
    if sum(stop - start for start, stop in blocks) != hi - lo:  # a gap or an overlap
        raise ValueError(f"this process's rows of the batch are not one block: {blocks}")
    return jax.make_array_from_process_local_data(sharding, host[lo:hi], host.shape)


def transfer(tree, shardings):
    """`tree` copied onto `shardings` (a matching tree) on other devices: the weight push from
    the trainer's devices to the generator's.

    One process: a resharding `jax.device_put`. Several processes (where device_put cannot move
    between disjoint device sets): leaf by leaf, one collective over the source devices leaves
    the leaf whole on every process, split over that process's own source devices
    (`host_split`: a leaf over their count on each, never a copy of the model, nor of a leaf,
    on one device); each process then builds its own target devices' parts from those
    pieces, device to device, and the pieces are freed before the next leaf. Every process
    must hold devices of both sets (`pipeline.generator_devices` takes some devices of every
    process).
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(shardings)
    return treedef.unflatten([_transfer_leaf(x, t) for x, t in zip(leaves, targets, strict=True)])


def host_split(x: jax.Array) -> jax.sharding.NamedSharding:
    """A layout of `x` over its own devices in which every process holds the whole of it,
    split over that process's devices along the first axis their count divides (whole on
    each where none does): what a leaf is gathered to before it moves to the generator."""
    by_process: dict[int, list] = {}
    for d in sorted(x.sharding.device_set, key=lambda d: d.id):
        by_process.setdefault(d.process_index, []).append(d)
    counts = {len(ds) for ds in by_process.values()}
    if len(counts) != 1:
        raise ValueError(f"the source devices differ in number between processes: {counts}")
    local = counts.pop()
    grid = np.array([by_process[p] for p in sorted(by_process)])
    mesh = jax.sharding.Mesh(grid, ("process", "local"))
    spec = [None] * x.ndim
    dims = [i for i, n in enumerate(x.shape) if n % local == 0]
    if dims and local > 1:
        spec[dims[0]] = "local"
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def _transfer_leaf(x: jax.Array, target) -> jax.Array:
    if not x.addressable_shards:
        raise ValueError(f"process {jax.process_index()} holds none of the source devices")
    staged = jax.device_put(x, host_split(x))  # a collective over the source devices
    bounds = lambda index: [sl.indices(n) for sl, n in zip(index, x.shape, strict=True)]  # noqa: E731
    pieces: dict[str, tuple] = {}  # one piece per distinct part (a part may be on several)
    for shard in staged.addressable_shards:
        pieces.setdefault(repr(shard.index), (bounds(shard.index), shard.data))
    axis = next((i for i, p in enumerate(staged.sharding.spec) if p), 0)  # the split one
    parts = []
    for device, index in target.addressable_devices_indices_map(x.shape).items():
        want = bounds(index)
        blocks = []
        for got, data in pieces.values():
            lo = [max(w[0], g[0]) for w, g in zip(want, got, strict=True)]
            hi = [min(w[1], g[1]) for w, g in zip(want, got, strict=True)]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            cut = tuple(slice(a - g[0], b - g[0]) for a, b, g in zip(lo, hi, got, strict=True))
            blocks.append((lo, jax.device_put(data[cut], device)))
        blocks.sort(key=lambda b: b[0])
        joined = (
            blocks[0][1]
            if len(blocks) == 1
            else jax.numpy.concatenate([b for _, b in blocks], axis=axis)
        )
        parts.append(joined)
    out = jax.make_array_from_single_device_arrays(x.shape, target, parts)
    if staged is not x:
        out.block_until_ready()
        staged.delete()
    return out


def _kv_client():
    """The `jax.distributed` coordination service's key-value store client (None in one
    process): what JAX's own checkpointing uses to wait on other processes."""
    from jax._src import distributed as jax_distributed  # no public handle as of jax 0.10

    return jax_distributed.global_state.client


def announce(key: str, value: str = "1") -> None:
    """Publish `key` in the job's key-value store (for `wait_for` on other processes)."""
    client = _kv_client()
    if client is not None:
        client.key_value_set(key, value)


def publish(key: str, value: str) -> None:
    """Set `key` to `value` in the job's key-value store, over what it held (`peek` reads)."""
    client = _kv_client()
    if client is not None:
        client.key_value_set(key, value, allow_overwrite=True)


def peek(key: str) -> str | None:
    """`key`'s value in the job's key-value store now, None if it has none (no wait)."""
    client = _kv_client()
    if client is None:
        return None
    try:
        return client.key_value_try_get(key)
    except Exception:  # not set (yet)
        return None


def forget(key: str) -> None:
    """Delete `key` from the job's key-value store (announced, and read by everyone)."""
    client = _kv_client()
    if client is not None:
        client.key_value_delete(key)


def wait_for(key: str, timeout: float, what: str) -> str | None:
    """Wait (not in a collective, which would time out on its own) until process 0 announced
    `key`; TimeoutError naming what was waited for after `timeout` seconds."""
    client = _kv_client()
    if client is None:
        return None
    try:
        return client.blocking_key_value_get(key, int(timeout * 1000))
    except Exception as e:  # the client raises a runtime error carrying DEADLINE_EXCEEDED
        if "DEADLINE_EXCEEDED" not in str(e):  # the job's coordination itself failed
            raise
        raise TimeoutError(
            f"process {jax.process_index()}: process 0 did not announce {what} within "
            f"{timeout:.0f} s ({e})"
        ) from None
