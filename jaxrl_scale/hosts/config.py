"""Generator jobs on hosts of their own (`hosts.*`)."""

from __future__ import annotations

import dataclasses

from jaxrl_scale.configbase import require
from jaxrl_scale.parallel.config import MeshConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostsConfig:
    """Trainer and generators as separate jobs (docs/hosts.md). The trainer's processes form
    one `jax.distributed` job (`distributed`, `mesh`); each generator group is a job of its own
    on other hosts (`generator_mesh` over its devices), started with `--role generator --group
    N`. Weights move device to device over `jax.experimental.transfer`; control messages and
    scored rollouts over ZeroMQ. 0 groups: generation is colocated with training, as before."""

    generator_groups: int = 0
    hub: str = "127.0.0.1:5555"  # host:port the trainer's process 0 binds; generators connect
    # The address other hosts reach this process at, for its weight and transfer servers
    # ("": the hub's host on the trainer's process 0, else this host's name; JAXRL_HOST).
    address: str = ""
    generator_mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    # Seconds a wait on another host may take before it fails naming that host and what it
    # waited for; a generator retries the trainer for this long (a trainer restarting).
    timeout: float = 300.0
    lost_after: float = 60.0  # seconds of silence after which a group's batch is drawn again
    # Seconds a generator group that has worked for a trainer waits for it to come back when
    # it falls silent (a restart: load, restore and compile can take minutes at 8B) before
    # it gives up; a group that never reached a trainer gives up after `timeout`.
    restart_timeout: float = 1800.0
    # Seconds a group holding work may go without progress (a decode chunk started, a piece of
    # work asked for) while its heartbeat goes on, before it counts as lost: a hung decode.
    # Generous: a first compile and a batch's scoring (sandboxed programs) count as no progress.
    stalled_after: float = 1800.0

    def __post_init__(self):
        require(self.generator_groups >= 0, "hosts.generator_groups", "must be >= 0")
        host, _, port = self.hub.rpartition(":")
        require(bool(host) and port.isdigit(), "hosts.hub", f"must be host:port, got {self.hub!r}")
        for name in ("timeout", "lost_after", "restart_timeout", "stalled_after"):
            require(getattr(self, name) > 0, f"hosts.{name}", "must be > 0 seconds")
