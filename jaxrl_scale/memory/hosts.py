"""The plan of generator jobs on hosts of their own (`hosts.generator_groups`): each group's
mesh and the programs its devices compile."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxrl_scale.memory.abstract import abstract_params, adapter_bytes
from jaxrl_scale.memory.generator import bound_evaluation, evaluate_memory, float32_config
from jaxrl_scale.parallel import sharding

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
    the version being received) and no evaluation (the trainer evaluates); the trainer's hold
    the train step, and beside the train state the versions its weight server keeps laid out
    for the generators (`weights.WeightServer`: 2, each split over all trainer devices), and
    between steps a held-out evaluation with a copy of its own. With LoRA a version is its
    adapters."""
    gen = report["generator"]
    gen["per_device_bytes"] -= gen["evaluation_bytes"]
    gen["evaluation_bytes"] = 0
    _, params = abstract_params(cfg, mesh, generation=True)
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    if cfg.model.lora.enabled:  # a version is its adapters (the generators hold the base)
        total = adapter_bytes(params, per_device=False)
    held = 2 * -(-total // mesh.devices.size)
    train = report["train_step"]
    evaluation = evaluate_memory(cfg, mesh, prompt_len, copy=True, own_copy=True)
    wide_cfg = float32_config(cfg)
    if wide_cfg is not None:  # the CPU's bf16 programs: the smaller of two upper bounds
        wide = evaluate_memory(wide_cfg, mesh, prompt_len, copy=True, own_copy=True)
        bound_evaluation(evaluation, wide)
    report["trainer_evaluate"] = evaluation
    resident = train["parameters_bytes"] + train["optimizer_state_bytes"]
    report["trainer_host"] = {
        "train_step_bytes": train["per_device_bytes"],
        "held_versions_bytes": held,
        "evaluation_bytes": evaluation["per_device_bytes"],
        "per_device_bytes": held + max(train["per_device_bytes"],
                                       resident + evaluation["per_device_bytes"]),
    }  # fmt: skip
