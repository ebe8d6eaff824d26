"""Checkpoints with orbax: one `RunState` (everything a run needs to go on) as one orbax item.

The item is a tree with two parts: `train` (the train state, sharded on the trainer's mesh and
restored onto it, resharded if the device count changed) and `host` (numpy arrays: curriculum,
rng key, running totals, and the batches generated but not yet trained on). The host part's
shape varies (0 to k pending batches, each with its own prompt length), so a restore reads it
from the checkpoint's metadata first. The resume order is written where it is followed:
train.py's "resume" section.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxrl_scale.step import TrainState


@dataclasses.dataclass(frozen=True)
class RunState:
    """A run after `step` RL steps (the policy version, pipeline.py)."""

    step: int
    train: TrainState
    curriculum: dict[str, np.ndarray]  # Curriculum.state_dict() as of the last batch drawn
    key: jax.Array  # the run's rng key (per-step keys fold the step in)
    totals: dict[str, float]  # compute_flops, device_seconds, tokens, skipped/dropped counts
    pending: list[Any]  # batches generated for the next steps (rollout.Rollouts)


def abstract_like(tree):
    """Shapes, dtypes and shardings of `tree` (a restore target)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Checkpointer:
    def __init__(self, run_dir: str | Path, *, keep: int = 3):
        self.directory = Path(run_dir).absolute() / "checkpoints"
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            # Named up front, so a fresh manager can read an item's metadata before a restore.
            item_handlers=ocp.StandardCheckpointHandler(),
        )

    def save(self, run: RunState, pending_to_host: Callable[[list], dict]) -> None:
        """Save asynchronously (the train state is copied first, so training goes on)."""
        host = {
            "curriculum": dict(run.curriculum),
            "key": np.asarray(jax.random.key_data(run.key)),
            "totals": {k: np.asarray(v) for k, v in run.totals.items()},
            "pending": pending_to_host(run.pending),
        }
        tree = {"train": run.train, "host": host}
        self.manager.save(run.step, args=ocp.args.StandardSave(tree))

    def restore_latest(
        self, abstract_train: TrainState, pending_from_host: Callable[[dict], list]
    ) -> RunState | None:
        """The newest readable checkpoint, or None. A corrupt or partly written newest
        checkpoint is skipped with a warning and the one before it used."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                meta = self.manager.item_metadata(step).tree["host"]
                host_target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), meta)
                target = {"train": abstract_train, "host": host_target}
                tree = self.manager.restore(step, args=ocp.args.StandardRestore(target))
            except Exception as e:  # orbax raises many types for damaged files
                warnings.warn(
                    f"checkpoint {step} in {self.directory} is unreadable ({e}); trying older",
                    stacklevel=2,
                )
                continue
            host = tree["host"]
            return RunState(
                step=step,
                train=tree["train"],
                curriculum=host["curriculum"],
                key=jax.random.wrap_key_data(jnp.asarray(host["key"], jnp.uint32)),
                totals={k: np.asarray(v).item() for k, v in host["totals"].items()},
                pending=pending_from_host(host["pending"]),
            )
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
