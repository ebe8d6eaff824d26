"""A staleness-bounded rollout buffer: at most `capacity` batches, none handed out stale.

Each batch carries the policy version of every sampled token (-1 where nothing was sampled).
The consumer asks with its current version v; a batch whose oldest sampled token is older than
v - k is dropped instead of returned: counted, and kept for the consumer to account for
(`take_dropped`), never lost silently. `put` blocks while the buffer is full. The bound itself is
the producer's to keep (pipeline.PipelineFeeder starts a batch only when it cannot arrive more
than k versions late); dropping is the last line of defence.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def oldest_version(versions) -> int | None:
    """The oldest policy version among sampled tokens (entries >= 0), None when there are none."""
    sampled = np.asarray(versions)
    sampled = sampled[sampled >= 0]
    return int(sampled.min()) if sampled.size else None


class RolloutBuffer:
    def __init__(self, max_staleness: int, capacity: int | None = None):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.k = max_staleness
        self._queue: queue.Queue = queue.Queue(maxsize=capacity or max(max_staleness, 1))
        self._error: BaseException | None = None
        # Touched only by the consumer thread (in `get` and `take_dropped`).
        self.dropped = 0
        self._dropped_items: list[Any] = []

    def put(self, item: Any, versions, *, halt: threading.Event | None = None,
            idle: Callable[[], bool] | None = None) -> bool:  # fmt: skip
        """Add a batch tagged with its per-token `versions`, waiting while the buffer is full
        (calling `idle` meanwhile, if given: the producer's work that goes on; it returns
        whether there was any). Returns False, without adding, if `halt` is set while
        waiting."""
        entry = (item, oldest_version(versions))
        while halt is None or not halt.is_set():
            try:
                self._queue.put_nowait(entry)
                return True
            except queue.Full:
                pass
            if idle is None or not idle():  # nothing else to do: wait for room
                try:
                    self._queue.put(entry, timeout=0.1)
                    return True
                except queue.Full:
                    continue
        return False

    def put_error(self, error: BaseException) -> None:
        """Hand a producer's failure to the consumer: its next `get` raises it. Never blocks,
        even on a full buffer."""
        self._error = error

    def ready(self) -> bool:
        """`get` would return (or raise) without waiting, staleness aside."""
        return self._error is not None or not self._queue.empty()

    def get(self, current_version: int, *, timeout: float = 600.0) -> Any:
        """The oldest batch no more than k versions behind `current_version`; staler batches
        are dropped. Raises queue.Empty after `timeout` seconds without one."""
        deadline = time.monotonic() + timeout
        while True:
            if self._error is not None:
                raise RuntimeError("the rollout producer failed") from self._error
            left = deadline - time.monotonic()
            if left <= 0:
                raise queue.Empty
            try:
                item, oldest = self._queue.get(timeout=min(left, 0.1))
            except queue.Empty:
                continue
            if oldest is None or current_version - oldest <= self.k:
                return item
            self.dropped += 1
            self._dropped_items.append(item)

    def __len__(self) -> int:
        """Batches waiting to be taken (exact once the producer has stopped)."""
        return self._queue.qsize()

    def take_dropped(self) -> list[Any]:
        """The batches dropped as stale since the last call (their work is still the run's)."""
        items, self._dropped_items = self._dropped_items, []
        return items
