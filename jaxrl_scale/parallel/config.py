"""Where a run's arrays live: the device mesh (`mesh.*`) and the processes of a
multi-controller run (`distributed.*`)."""

from __future__ import annotations

import dataclasses

from jaxrl_scale.configbase import require


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh shape. -1 on one axis means "all remaining devices"."""

    data: int = -1
    fsdp: int = 1
    # Expert parallelism: an MoE layer's experts split over this axis (num_experts a multiple
    # of it); outside MoE layers it splits rows like `data`, and with fsdp > 1 the other
    # weights like `fsdp`. (Generator devices split the experts over all of them.)
    expert: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = {"data": self.data, "fsdp": self.fsdp, "expert": self.expert, "tensor": self.tensor}
        for name, size in sizes.items():
            require(size == -1 or size >= 1, f"mesh.{name}", f"must be -1 or >= 1, got {size}")
        require(list(sizes.values()).count(-1) <= 1, "mesh", "at most one axis may be -1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """Several processes (hosts) in one run, through jax.distributed (distributed.py). Unset
    fields come from JAXRL_COORDINATOR / JAXRL_NUM_PROCESSES / JAXRL_PROCESS_ID, or from the
    Cloud TPU / Slurm environment; with none of those the run is one process."""

    coordinator_address: str | None = None  # "host:port" of process 0, bound exactly
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout: int = 300  # seconds to wait for every process to join
    heartbeat_timeout: int = 100  # seconds without a heartbeat before a process counts as dead

    def __post_init__(self):
        require(
            self.num_processes is None or self.num_processes >= 1,
            "distributed.num_processes",
            "must be >= 1",
        )
        require(
            self.process_id is None or self.process_id >= 0,
            "distributed.process_id",
            "must be >= 0",
        )
        for name in ("initialization_timeout", "heartbeat_timeout"):
            require(getattr(self, name) >= 1, f"distributed.{name}", "must be >= 1 second")
