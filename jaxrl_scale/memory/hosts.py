"""The plan of generator jobs on hosts of their own (`hosts.generator_groups`): each group's
mesh and the programs its devices compile."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxrl_scale.memory.abstract import abstract_params, abstract_policy, adapter_bytes, placed
from jaxrl_scale.models.policy import for_generation
from jaxrl_scale.parallel import sharding
from jaxrl_scale.parallel.rows import layout_program

if TYPE_CHECKING:  # the root config composes every part's section
    from jaxrl_scale.config import ExperimentConfig


def group_mesh(cfg: ExperimentConfig):
    """A generator group's mesh (`hosts.generator_mesh`, -1: all devices here), on this
    machine's devices: the plan of one group's hosts."""
    m = cfg.hosts.generator_mesh
    sizes = [m.data, m.fsdp, m.expert, m.tensor]
    fixed = int(np.prod([x for x in sizes if x != -1]))
    n = fixed * (len(jax.devices()) // fixed) if -1 in sizes else fixed
    if n > len(jax.devices()) or n < 1:
        raise ValueError(f"hosts.generator_mesh needs {n} devices; {len(jax.devices())} here")
    return sharding.make_mesh(m, jax.devices()[:n])


def plan_hosts(report: dict[str, Any], cfg: ExperimentConfig, mesh, prompt_len: int) -> None:
    """Generators are jobs of their own: their devices hold two copies (the one decoding and
    the version being received) and evaluate held-out prompts between their batches, in a
    batch's place (hub.py: the trainer hands its evaluations to the groups); the trainer's
    hold the train step, and beside the train state the versions its weight server keeps
    laid out for the generators (`weights.WeightServer`: 2, each split over all trainer
    devices). With LoRA a version is its adapters."""
    gen, ev = report["generator"], report["evaluate"]
    batch = gen["decode_state_bytes"] + gen["working_bytes"]
    gen["evaluation_bytes"] = max(0, ev["per_device_bytes"] - batch)  # beyond a batch's
    gen["evaluation_between_batches"] = True
    gen["per_device_bytes"] = gen["parameters_bytes"] + max(batch, ev["per_device_bytes"])
    _, params = abstract_params(cfg, mesh, generation=True)
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    if cfg.model.lora.enabled:  # a version is its adapters (the generators hold the base)
        total = adapter_bytes(params, per_device=False)
    version = -(-total // mesh.devices.size)
    train = report["train_step"]
    resident = train["parameters_bytes"] + train["optimizer_state_bytes"]
    # Publishing (between steps) lays the new version out while the two before are held,
    # beside the train state: three versions and the layout program's temporaries.
    layout = _layout_temporaries(cfg, mesh, int(np.prod(list(report["generate_mesh"].values()))))
    publish = resident + 3 * version + layout
    report["trainer_host"] = {
        "train_step_bytes": train["per_device_bytes"],
        "held_versions_bytes": 2 * version,
        "publish_bytes": publish,
        "layout_temporaries_bytes": layout,
        "per_device_bytes": max(2 * version + train["per_device_bytes"], publish),
    }


def _layout_temporaries(cfg: ExperimentConfig, mesh, gen_devices: int) -> int:
    """Per-device temporaries of the program that lays a version out for the generators
    (`parallel.rows.layout_program`, as `weights.WeightServer` runs it), compiled for the
    trained parameters as the train state holds them (with LoRA the adapters)."""
    _, _, trained = abstract_policy(cfg)
    rows = math.lcm(mesh.devices.size, gen_devices)
    cast = lambda p: for_generation(p, cfg.model, copy=False)  # noqa: E731
    program = layout_program(mesh, rows, cast).lower(placed(trained, mesh)).compile()
    return int(program.memory_analysis().temp_size_in_bytes)
