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

from jaxrl_scale.rl.step import TrainState


@dataclasses.dataclass(frozen=True)
class RunState:
    """A run after `step` RL steps (the policy version, pipeline.py)."""

    step: int
    train: TrainState
    curriculum: dict[str, np.ndarray]  # Curriculum.state_dict() as of the last batch drawn
    key: jax.Array  # the run's rng key (per-step keys fold the step in)
    totals: dict[str, float]  # compute_flops, device_seconds, tokens, skipped/dropped counts
    pending: list[Any]  # batches generated for the next steps (rollout.Rollouts)
    # A LoRA run's base: its fingerprint (lora.fingerprint), not a copy; None without LoRA.
    base: np.ndarray | None = None


class CheckpointError(ValueError):
    """The run directory has checkpoints, but none this run can continue from."""


class CheckpointMismatch(CheckpointError):
    """A checkpoint holds a train state of other shapes than this run's config makes."""


def _shapes(tree) -> dict[str, tuple]:
    """'params/embedding/value' -> shape, for a state or its checkpoint metadata alike."""

    def name(path) -> str:
        return "/".join(
            str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path
        )

    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {name(path): tuple(leaf.shape) for path, leaf in flat}


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
        if run.base is not None:
            host["base"] = np.asarray(run.base)
        tree = {"train": run.train, "host": host}
        self.manager.save(run.step, args=ocp.args.StandardSave(tree))

    def restore_latest(
        self,
        abstract_train: TrainState,
        pending_from_host: Callable[[dict], list],
        *,
        base: np.ndarray | None = None,
    ) -> RunState | None:
        """The newest readable checkpoint, or None when there is none. A corrupt or partly
        written newest checkpoint is skipped with a warning and the one before it used; when
        checkpoints exist but none can be read (or one is of another model) it is an error,
        never a silent start from scratch that would overwrite the run's metrics. `base`: a
        LoRA run's base fingerprint, which must be the one the checkpoint's adapters were
        trained on."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        for step in steps:
            if (self.directory / str(step) / "state").exists():  # the format before RunState
                raise CheckpointError(
                    f"checkpoint {step} in {self.directory} has the layout of jaxrl-scale "
                    "before the one-item run state: resume it with that version, or start "
                    "over with --no-resume"
                )
            try:
                meta = self.manager.item_metadata(step).tree
                self._check_shapes(step, meta["train"], abstract_train)
                host_target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), meta["host"])
                target = {"train": abstract_train, "host": host_target}
                tree = self.manager.restore(step, args=ocp.args.StandardRestore(target))
                _check_base(step, self.directory, tree["host"].get("base"), base)
            except CheckpointMismatch:
                raise
            except Exception as e:  # orbax raises many types for damaged files
                warnings.warn(
                    f"checkpoint {step} in {self.directory} is unreadable ({e}); trying older",
                    stacklevel=2,
                )
                continue
            host = tree["host"]
            saved_base = host.get("base")
            return RunState(
                step=step,
                train=tree["train"],
                curriculum=host["curriculum"],
                key=jax.random.wrap_key_data(jnp.asarray(host["key"], jnp.uint32)),
                totals={k: np.asarray(v).item() for k, v in host["totals"].items()},
                pending=pending_from_host(host["pending"]),
                base=None if saved_base is None else np.asarray(saved_base),
            )
        if steps:
            raise CheckpointError(
                f"none of the checkpoints {steps} in {self.directory} can be read (see the "
                "warnings): start over with --no-resume, or remove the damaged ones"
            )
        return None

    def _check_shapes(self, step: int, saved, abstract_train) -> None:
        """Refuse a checkpoint of another model or optimiser (rather than skip it and start
        over, which would overwrite the run's metrics)."""
        have, want = _shapes(saved), _shapes(abstract_train)
        if have == want:
            return
        diff = sorted(set(have) ^ set(want)) or [k for k in want if have[k] != want[k]]
        first = diff[0]
        raise CheckpointMismatch(
            f"checkpoint {step} in {self.directory} holds a train state this config does not "
            f"make ({first}: {have.get(first, 'absent')} in the checkpoint, "
            f"{want.get(first, 'absent')} here; {len(diff)} entries differ): resume with the "
            "config that wrote it (RUN/config.yaml), or start over with --no-resume"
        )

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def restore_params(run_dir: str | Path, abstract_params, *, base: np.ndarray | None = None):
    """(step, trainable parameters) of a run's newest readable checkpoint, read without
    writing anything under `run_dir` and without the rest of the run state (optimizer,
    curriculum, pending batches): what `export` reads. `abstract_params`: the shapes, dtypes
    and shardings to restore onto; `base`: a LoRA run's base fingerprint, checked as on
    resume. FileNotFoundError when the run has no checkpoint."""
    import logging

    directory = Path(run_dir).absolute() / "checkpoints"
    if not directory.is_dir():
        raise FileNotFoundError(f"{run_dir}: no checkpoints/ folder (no checkpoint to export)")
    absl = logging.getLogger("absl")  # orbax logs a warning per read-only manager
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        manager = ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(read_only=True, create=False),
            item_handlers=ocp.PyTreeCheckpointHandler(),
        )
    finally:
        absl.setLevel(level)
    try:
        steps = sorted(manager.all_steps(), reverse=True)
        for step in steps:
            try:
                meta = manager.item_metadata(step).tree
                have, want = _shapes(meta["train"]["params"]), _shapes(abstract_params)
                if have != want:
                    raise CheckpointMismatch(
                        f"checkpoint {step} in {directory} holds parameters of other shapes "
                        "than the run's config.yaml makes"
                    )
                target = {"train": {"params": abstract_params}}
                saved_base = meta["host"].get("base")
                if saved_base is not None:  # a LoRA run's: checked below
                    target["host"] = {"base": np.zeros(saved_base.shape, saved_base.dtype)}
                args = ocp.args.PyTreeRestore(
                    item=target,
                    restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                    partial_restore=True,
                )
                tree = manager.restore(step, args=args)
            except CheckpointMismatch:
                raise
            except Exception as e:  # orbax raises many types for damaged files
                warnings.warn(
                    f"checkpoint {step} in {directory} is unreadable ({e}); trying older",
                    stacklevel=2,
                )
                continue
            saved = tree.get("host", {}).get("base")
            _check_base(step, directory, saved, base)
            return step, tree["train"]["params"]
    finally:
        manager.close()
    if steps:
        raise CheckpointError(f"none of the checkpoints {steps} in {directory} can be read")
    raise FileNotFoundError(f"{run_dir}: no checkpoint to export")


def _check_base(step: int, directory: Path, saved, base: np.ndarray | None) -> None:
    """Refuse adapters saved on top of another base than this run's (or a LoRA state
    where this run has none, and the reverse)."""
    from jaxrl_scale.models.lora import same_base

    if saved is None and base is None:
        return
    if saved is None or base is None:
        have, want = ("no", "a") if saved is None else ("a", "no")
        raise CheckpointMismatch(
            f"checkpoint {step} in {directory} has {have} LoRA base, this config has "
            f"{want} (model.lora.rank): resume with the config that wrote it "
            "(RUN/config.yaml), or start over with --no-resume"
        )
    if not same_base(np.asarray(saved), base):
        raise CheckpointMismatch(
            f"checkpoint {step} in {directory} holds LoRA adapters trained on another "
            "base model than this run's (model.init_from / seed): resume with the base "
            "they were trained on, or start over with --no-resume"
        )
