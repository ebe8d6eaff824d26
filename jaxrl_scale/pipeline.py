"""How rollouts reach the trainer: the three modes, behind one `next()` / `stop()` interface.

- `sync` (k = 0): generate one batch with the current parameters, train on it, repeat.
- `ppo_off_policy`: generate k batches with one set of parameters, then take k steps on them.
- `pipeline_rl` (PipelineRL-k): a generator thread samples continuously into a
  `RolloutBuffer`; the trainer publishes parameters after every step and the generator picks
  them up between decode chunks (in flight), so one completion may carry several versions.

A producer is `rollouts(params_source, key) -> batch` where `params_source()` returns the newest
(version, params) and the batch has a `versions` array (per-token policy version, -1 if none).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax

from jaxrl_scale.buffer import RolloutBuffer

Producer = Callable[[Callable[[], tuple[int, Any]], jax.Array], Any]


class ParamsSource:
    """The newest published parameters and their version, read by the generator. `place` puts
    published parameters where the generator reads them (a copy, or another device set)."""

    def __init__(self, version: int, params, *, place: Callable[[Any], Any] = lambda p: p):
        self._lock = threading.Lock()
        self._place = place
        self.publish(version, params)

    def publish(self, version: int, params) -> None:
        params = self._place(params)
        with self._lock:
            self._latest = (version, params)

    def __call__(self) -> tuple[int, Any]:
        with self._lock:
            return self._latest


class SyncFeeder:
    """sync: one batch per policy version; ppo_off_policy: `per_policy` batches per version.
    Batch keys depend only on the round, so a run is reproducible and resumable exactly."""

    def __init__(self, produce: Producer, source: ParamsSource, key, *, per_policy: int, round_):
        self.produce, self.source, self.key = produce, source, key
        self.per_policy, self.round = per_policy, round_
        self.pending: list[Any] = []

    def next(self) -> Any:
        if not self.pending:
            version, params = self.source()
            frozen = lambda: (version, params)  # noqa: E731
            for i in range(self.per_policy):
                key = jax.random.fold_in(self.key, self.round * self.per_policy + i)
                self.pending.append(self.produce(frozen, key))
            self.round += 1
        return self.pending.pop(0)

    def stop(self) -> None:
        pass


class PipelineFeeder:
    """pipeline_rl: a generator thread fills a buffer of at most k batches from the newest
    published parameters. The trainer never gets a batch older than k versions: the bounded
    buffer keeps the generator at most k batches ahead, and stale batches are dropped."""

    def __init__(
        self, produce: Producer, source: ParamsSource, key, *, k: int, version: Callable[[], int]
    ):
        self.produce, self.source, self.key, self.version = produce, source, key, version
        self.buffer = RolloutBuffer(k)
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._run, name="generator", daemon=True)
        self.thread.start()

    @property
    def dropped(self) -> int:
        return self.buffer.dropped

    def _run(self) -> None:
        n = 0
        try:
            while not self.halt.is_set():
                batch = self.produce(self.source, jax.random.fold_in(self.key, 2**20 + n))
                n += 1
                if not self.buffer.put(batch, batch.versions, halt=self.halt):
                    return
        except BaseException as e:  # surfaced in the trainer thread
            self.buffer.put_error(e)

    def next(self) -> Any:
        return self.buffer.get(self.version())

    def stop(self) -> None:
        self.halt.set()
        self.thread.join(timeout=60)
