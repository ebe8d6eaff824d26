"""Checkpoints with orbax: train state, curriculum, data position, rng and policy version together.

Resume order (written once, here): restore the train state (parameters, optimizer, step), then
the curriculum (epoch, position, pass rates, retired prompts), then the run's rng key and the
metrics offset (rows after the checkpoint's step are dropped from metrics.jsonl), then (pipeline_rl
in lockstep) the batch already generated for the next step, so that the run continues exactly.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, run_dir: str | Path, *, keep: int = 3):
        self.directory = Path(run_dir).absolute() / "checkpoints"
        self.batches = Path(run_dir).absolute() / "batches"
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        )

    def save(
        self, step: int, state, extra: dict[str, Any], arrays: dict[str, np.ndarray] | None = None
    ) -> None:
        """Save asynchronously. `arrays` (host data such as a batch already generated for the
        next step) go to `batches/STEP.npz`, written by process 0 before the checkpoint, so a
        checkpoint that exists has them."""
        if arrays is not None and jax.process_index() == 0:
            self.batches.mkdir(parents=True, exist_ok=True)
            tmp = self.batches / f".{step}.npz"
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, self.batches / f"{step}.npz")
            kept = set(self.manager.all_steps()) | {step}
            for old in self.batches.glob("*.npz"):
                if old.stem.isdigit() and int(old.stem) not in kept:
                    old.unlink(missing_ok=True)
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(extra)
            ),
        )

    def arrays(self, step: int) -> dict[str, np.ndarray] | None:
        """The arrays saved with checkpoint `step`, or None (none saved, or unreadable: then
        with a warning)."""
        path = self.batches / f"{step}.npz"
        if not path.exists():
            return None
        try:
            with np.load(path, allow_pickle=False) as data:
                return {k: data[k] for k in data.files}
        except Exception as e:  # numpy raises several types for damaged files
            warnings.warn(f"{path} is unreadable ({e}); it is regenerated", stacklevel=2)
            return None

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
