"""Run metrics: one JSON object per logged step in metrics.jsonl, the scalars to TensorBoard."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Appends rows to `<run>/metrics.jsonl` (flushed per row) and TensorBoard event files;
    with `name` and no `tensorboard`, rows of another kind (rollouts.jsonl's samples)."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        resume_step: int | None = None,
        enabled: bool = True,
        name: str = "metrics.jsonl",
    ):
        self.enabled = enabled  # False: a process other than the writer; writes nothing
        self.path = Path(run_dir) / name
        self._file = self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            self._truncate_after(resume_step)
        elif self.path.exists():
            self.path.unlink()
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def _truncate_after(self, step: int) -> None:
        """Keep only rows up to `step`: rows a killed run logged after its last checkpoint
        would otherwise appear twice once the resumed run logs them again."""
        if not self.path.exists():
            return
        kept = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", -1) <= step
        ]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: _plain(v) for k, v in row.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in clean.items():
                if key != "step" and isinstance(value, int | float) and math.isfinite(value):
                    self._tb.add_scalar(key, value, clean["step"])

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _plain(value):
    """numpy / jax scalars -> Python numbers (JSON has no NaN: those become null)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
