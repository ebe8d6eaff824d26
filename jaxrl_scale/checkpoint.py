"""Checkpoints with orbax: train state, curriculum, data position, rng and policy version together.

Resume order (written once, here): restore the train state (parameters, optimizer, step), then
the curriculum (epoch, position, pass rates, retired prompts), then the run's rng key and the
metrics offset (rows after the checkpoint's step are dropped from metrics.jsonl).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, run_dir: str | Path, *, keep: int = 3):
        self.directory = Path(run_dir).absolute() / "checkpoints"
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        )

    def save(self, step: int, state, extra: dict[str, Any]) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(extra)
            ),
        )

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def restore_latest(self, abstract_state):
        """(step, state, extra) of the newest readable checkpoint, or None. A corrupt or partly
        written newest checkpoint is skipped with a warning and the one before it used."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state), extra=ocp.args.JsonRestore()
                    ),
                )
                return step, restored["state"], restored["extra"]
            except Exception as e:  # orbax raises many types for damaged files
                warnings.warn(
                    f"checkpoint {step} in {self.directory} is unreadable ({e}); trying older",
                    stacklevel=2,
                )
        return None

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
